"""Several ranks on one GPU, for debugging: a process group whose CUDA collectives travel through host copies.

NCCL refuses two ranks on one device. :class:`HostRelayGroup` (a Python ``ProcessGroup``) runs every collective
over an inner gloo group, copying tensors on the relayed device to the host and back: gloo's speed, a debugging
mode. NCCL's rules still hold: a collective whose tensors the group does not serve is refused with torch's own
message. Tests relay ``"cpu"`` instead of ``"cuda"`` (:func:`register`), taking the same path.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
                                        BroadcastOptions, GatherOptions, ReduceOp, ReduceOptions,
                                        ReduceScatterOptions, ScatterOptions, _create_work_from_future)
from torch.futures import Future

NAME = "hostrelay"            # CPU tensors to gloo, CUDA tensors relayed: the mode's ``cpu:gloo,cuda:nccl``
CUDA_ONLY = "hostrelay_cuda"  # CUDA tensors only, as a bare ``nccl`` group

_REDUCING = (AllreduceOptions, ReduceOptions, ReduceScatterOptions)


def refuse_unserved(tensors, served) -> None:
    """Every tensor of a collective on its first tensor's device type, one the group serves; else torch's
    "No backend type associated with device type X"."""
    kind = tensors[0].device.type if tensors else None
    for t in tensors:
        if t.device.type != kind or kind not in served:
            raise RuntimeError(f"No backend type associated with device type {t.device.type} (sat_patches host "
                               f"relay: this group serves {' and '.join(sorted(served))}, one device per collective)")


def _flat(tensors) -> list:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for item in tensors for t in _flat(item)]


def _done(result=None):
    """A finished ``Work``: the relay waits for gloo and copies back before it returns."""
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class HostRelayGroup(dist.ProcessGroup):
    """A process group over an inner gloo group: tensors on ``device`` relayed through host copies, CPU tensors
    to gloo directly where ``serve_cpu``, anything else refused (:func:`refuse_unserved`)."""

    def __init__(self, store, rank: int, size: int, timeout, device: str = "cuda", serve_cpu: bool = True,
                 name: str = NAME):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # every rank connected before any leaves (else "Gloo connectFullMesh failed ... Connection closed by peer")
        self.gloo.barrier().wait()
        self.device_type = device
        self.served = {device, "cpu"} if serve_cpu else {device}
        self.name = name

    def getBackendName(self) -> str:
        return self.name

    def __repr__(self):
        return f"HostRelayGroup(rank {self.rank()} of {self.size()}, relays {self.device_type}, serves " \
               f"{sorted(self.served)})"

    # -- the relay --------------------------------------------------------------------------------------------
    def _run(self, method: str, outputs, inputs, opts, *extra, written: bool = True):
        """``gloo.<method>(outputs[, inputs], *extra, opts)``, through host copies where the tensors are on the
        relayed device; the outputs copied back where ``written``."""
        tensors = _flat(outputs) + (_flat(inputs) if inputs is not None else [])
        refuse_unserved(tensors, self.served)
        opts, average = self._gloo_opts(opts)
        relay = bool(tensors) and tensors[0].device.type == self.device_type
        host_out = _host(outputs) if relay else outputs
        host_in = _host(inputs) if relay and inputs is not None else inputs
        args = (host_out,) + ((host_in,) if inputs is not None else ()) + extra + (opts,)
        getattr(self.gloo, method)(*args).wait()
        if average:
            for t in _flat(host_out):
                t.div_(self.size())
        if relay and written:
            for device_t, host_t in zip(_flat(outputs), _flat(host_out)):
                device_t.copy_(host_t)
        return _done(outputs)

    def _gloo_opts(self, opts):
        """Gloo has no ``ReduceOp.AVG`` (NCCL has): it becomes a sum divided by the group size."""
        if isinstance(opts, _REDUCING) and opts.reduceOp == ReduceOp.AVG:
            summed = type(opts)()
            for field in ("rootRank", "rootTensor", "timeout", "asyncOp"):
                if hasattr(opts, field):
                    setattr(summed, field, getattr(opts, field))
            summed.reduceOp = ReduceOp.SUM
            return summed, True
        return opts, False

    # -- collectives ------------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=AllreduceOptions()):
        return self._run("allreduce", tensors, None, opts)

    def allreduce_coalesced(self, tensors, opts=AllreduceOptions()):
        for t in tensors:
            self.allreduce([t], opts)
        return _done(tensors)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        return self._run("broadcast", tensors, None, opts)

    def reduce(self, tensors, opts=ReduceOptions()):
        return self._run("reduce", tensors, None, opts, written=self.rank() == opts.rootRank)

    def allgather(self, output_lists, input_tensors, opts=AllgatherOptions()):
        return self._run("allgather", output_lists, input_tensors, opts)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        return self._run("_allgather_base", output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        return self._run("reduce_scatter", outputs, input_lists, opts)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        return self._run("_reduce_scatter_base", output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return _done(outputs)

    def gather(self, output_lists, input_tensors, opts=GatherOptions()):
        return self._run("gather", output_lists, input_tensors, opts)

    def scatter(self, outputs, input_lists, opts=ScatterOptions()):
        return self._run("scatter", outputs, input_lists, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=AllToAllOptions()):
        return self._run("alltoall_base", output, input, opts, output_split_sizes, input_split_sizes)

    def barrier(self, opts=BarrierOptions()):
        self.gloo.barrier(BarrierOptions()).wait()
        return _done()


def _host(tensors):
    """Host copies of ``tensors`` (nested lists kept), always new memory."""
    if isinstance(tensors, torch.Tensor):
        return tensors.detach().to("cpu", copy=True)
    return [_host(t) for t in tensors]


def register(name: str = NAME, device: str = "cuda", serve_cpu: bool = True) -> str:
    """Register backend ``name`` (once): a :class:`HostRelayGroup` relaying ``device``, serving the CPU too
    where ``serve_cpu``. Returns ``name``, for ``init_process_group(backend=...)``."""
    if name.lower() not in dist.Backend.backend_capability:
        def create(store, rank, size, timeout):
            return HostRelayGroup(store, rank, size, timeout, device=device, serve_cpu=serve_cpu, name=name)
        dist.Backend.register_backend(name, create, devices=(["cpu"] if serve_cpu else []) + [device])
    return name


def relayed_backend(backend: str) -> str:
    """The backend standing in for ``backend`` when ranks share a GPU: ``cpu:gloo,cuda:nccl`` becomes
    :data:`NAME` (the relay serves the CPU itself), a bare ``nccl`` or ``cuda:nccl`` :data:`CUDA_ONLY`; others stay."""
    parts = {}
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        parts[device.strip() or "cuda"] = name.strip().lower()
    if parts.get("cuda") not in ("nccl", NAME, CUDA_ONLY):
        return backend
    register(NAME), register(CUDA_ONLY, serve_cpu=False)
    return NAME if "cpu" in parts else CUDA_ONLY

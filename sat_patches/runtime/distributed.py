"""Process groups: a backend for each device (``cpu:gloo,cuda:nccl``), ranks that agree on their device,
the group destroyed before interpreter teardown, and collectives whose failure names the parameters they carried.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import warnings

import torch
import torch.distributed as dist

from ..core.coordination import NO_BACKEND, error_kinds
from ..core.registry import SatPatchesWarning
from . import devices, host_relay


def process_group_backend(requested: str = "nccl") -> str:
    """The backend to create the process group with, so that CPU tensors have one: a CUDA-only backend
    becomes ``cpu:gloo,cuda:<it>`` (``gloo`` without CUDA or NCCL); with ``SAT_PATCHES_SHARED_GPU=1`` the host
    relay takes NCCL's place. Backends that serve the CPU stay as they are."""
    shared = devices.shared_gpu()
    requested = (requested or "nccl").strip()
    if ":" in requested:
        devices_named = {part.split(":")[0].strip() for part in requested.split(",")}
        backend = requested if "cpu" in devices_named else f"cpu:gloo,{requested}"
    elif dist.Backend.backend_capability.get(requested.lower(), ["cpu"]).count("cpu"):  # unknown: as asked
        backend = requested
    elif requested.lower() == "nccl" and not shared and not (devices.cuda_available() and dist.is_nccl_available()):
        backend = "gloo"
    else:
        backend = f"cpu:gloo,cuda:{requested}"
    return host_relay.relayed_backend(backend) if shared else backend


def destroy_group_at_exit() -> None:
    """Destroy the default process group, if one is still there (registered with ``atexit``)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _all_gather_text(text: str, size: int = 512) -> list:
    """Every rank's ``text`` (up to ``size`` bytes), in rank order, over CPU tensors."""
    data = text.encode()[:size]
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in everyone]


def _say_device(kind: str, ranks: int) -> None:
    """Once per job: where it computes, and what the shared-GPU mode costs."""
    why = " (no CUDA device: DeepSpeed runs on its CPU accelerator)" if kind == "cpu" else ""
    print(f"sat_patches: {ranks} rank(s) compute on {kind}{why}", flush=True)
    if devices.shared_gpu():
        print(f"sat_patches: SAT_PATCHES_SHARED_GPU=1 (process group backend '{dist.get_backend()}'): " + (
            "no GPU to share on CPU ranks; their collectives still pass through the host relay's process group "
            "(CPU tensors over gloo)" if kind == "cpu" else
            "several ranks share each GPU; every CUDA collective goes through host copies over gloo (a debugging "
            "mode: slower than NCCL)"), flush=True)


def check_ranks_agree_on_device() -> None:
    """Every rank computes on the same kind of device, or the job stops here on every rank (a rank that sees
    no CUDA in a CUDA job would compute on its CPU until something times out)."""
    rank, mine = dist.get_rank(), devices.compute_device().type
    if dist.get_world_size() == 1:
        return
    seen = [text.split("|", 1) for text in _all_gather_text(f"{mine}|{devices.describe()}")]
    if len({kind for kind, _ in seen}) == 1:
        return _say_device(mine, len(seen)) if rank == 0 else None
    lines = [f"  rank {r} computes on {kind}: {what}" for r, (kind, what) in enumerate(seen)]
    raise RuntimeError("sat_patches: the ranks of this job do not agree on the compute device:\n" + "\n".join(lines)
                       + "\nMake CUDA visible on every node of a GPU job, or run every rank on CPU "
                         "(SAT_PATCHES_DEVICE=cpu, or CPU_RANKS with the finetune scripts).")


@contextlib.contextmanager
def explained_collectives(where: str, named_tensors):
    """Re-raise "No backend type associated with device type X" naming the SAT call site and the
    first tensor on a device the process group has no backend for."""
    try:
        yield
    except RuntimeError as exc:
        if NO_BACKEND not in error_kinds(exc):
            raise
        backend = str(dist.get_backend()) if dist.is_initialized() else "?"
        if ":" in backend:
            served = {part.split(":")[0].strip() for part in backend.split(",")}
        else:
            served = set(dist.Backend.backend_capability.get(backend.lower(), ["cpu", "cuda"]))
        culprit = next(((n, t) for n, t in named_tensors() if t.device.type not in served), None)
        what = (f"tensor '{culprit[0]}' is on {culprit[1].device}" if culprit
                else "a tensor is on a device")
        raise RuntimeError(
            f"{exc}\nsat_patches: in {where}: {what}, and the process group (backend '{backend}') has "
            f"no backend for it. Create the group with backend 'cpu:gloo,cuda:nccl' (sat_patches' "
            f"process_group_backend patch does this unless disabled) or put the tensor on the compute "
            f"device {devices.compute_device()}.") from exc


def training_device(args, model_given: bool):
    """The device ``training_main`` moves a passed-in model to: the compute device, not a 'cpu' that
    CogVLM's QLoRA demo put in ``args.device`` while CUDA is present."""
    compute = devices.compute_device()
    if model_given and compute.type == "cuda" and str(getattr(args, "device", "")) == "cpu":
        warnings.warn("args.device is 'cpu' but this rank computes on CUDA; training_main would move the "
                      f"whole model back to CPU. Using {compute}.", SatPatchesWarning, stacklevel=3)
        return compute.index
    return args.device


def initialize_distributed_with_backend(original, args):
    """SAT's NCCL-only group fails on CPU tensors: "No backend type associated with device type cpu"
    (THUDM/CogVLM#328, THUDM/SwissArmyTransformer#173). A backend for each device; ranks agree on their device."""
    created = not dist.is_initialized()
    if created:
        args.distributed_backend = process_group_backend(getattr(args, "distributed_backend", "nccl"))
    result = original(args)
    if created:
        check_ranks_agree_on_device()
    return result


def initialize_distributed_destroyed_at_exit(original, args):
    """SAT's ``initialize_distributed`` never destroys its group, which then dies in interpreter teardown where
    gloo's threads can abort the process (exit -6 after success; pytorch/pytorch#190489): destroyed at exit."""
    created = not dist.is_initialized()
    result = original(args)
    if created and dist.is_initialized():
        atexit.unregister(destroy_group_at_exit)  # once, however often a group is created
        atexit.register(destroy_group_at_exit)
    return result


def get_args_on_compute_device(original, args_list=None, parser=None):
    """SAT's ``get_args`` refuses any device but ``LOCAL_RANK`` ("LOCAL_RANK (default 0) and args.device
    inconsistent" on CPU, or where ranks share a GPU): while SAT checks, both name the compute device; the local
    rank is put back after, and ``args.device_rank`` names a shared GPU for DeepSpeed's engine."""
    compute = devices.compute_device()
    device = compute.index if compute.type == "cuda" else "cpu"
    if device == devices.local_rank():
        return original(args_list, parser)
    parser = parser if parser is not None else argparse.ArgumentParser(description="sat")
    parse, local_rank = parser.parse_args, []

    def parse_args(*a, **kw):
        ns = parse(*a, **kw)
        if getattr(ns, "device", None) == -1:
            local_rank.append(ns.local_rank if ns.local_rank is not None else devices.local_rank())
            ns.device = ns.local_rank = device
        return ns

    parser.parse_args = parse_args
    try:
        args = original(args_list, parser)
    finally:
        del parser.parse_args
    if local_rank:
        args.local_rank = local_rank[0]
    if compute.type == "cuda":
        args.device_rank = device
    return args

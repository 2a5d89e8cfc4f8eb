"""SAT_PATCHES_SHARED_GPU=1: several ranks on one GPU, their CUDA collectives carried by the host relay.

No CUDA here: the relay's path (host copies, the gloo collective on them, the results copied back) is run on CPU
ranks by a relay registered for the ``cpu`` device (the relayed device is a parameter); the refusal of a CPU tensor
is run on the production group, which relays ``cuda`` and is refused the CPU tensor before any CUDA is touched.
"""
import pytest
import torch

from sat_patches.core import settings
from sat_patches.runtime import devices, host_relay
from sat_patches.runtime.distributed import process_group_backend
from multirank import run_ranks


def collectives_through(backend_name):
    """Every collective SAT and DeepSpeed ZeRO-2 use, on the relay and on a plain gloo group: both results."""
    import torch.distributed as dist
    if backend_name == "relaytest":
        host_relay.register("relaytest", device="cpu", serve_cpu=False)
    dist.init_process_group(backend_name)
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"relay": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    seen = {}
    for name, group in groups.items():
        out = {}
        t = torch.tensor([1.0, 2.0]) * (rank + 1)
        dist.all_reduce(t, group=group)
        out["all_reduce"] = t.tolist()
        t = torch.tensor([1.0, 2.0], dtype=torch.bfloat16) * (rank + 1)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        out["all_reduce max bf16"] = t.tolist()
        t = torch.tensor([float(rank)])
        dist.broadcast(t, 1, group=group)
        out["broadcast"] = t.tolist()
        gathered = [torch.zeros(2) for _ in range(size)]
        dist.all_gather(gathered, torch.full((2,), float(rank)), group=group)
        out["all_gather"] = [g.tolist() for g in gathered]
        flat = torch.zeros(2 * size)
        dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)), group=group)
        out["all_gather_into_tensor"] = flat.tolist()
        t = torch.zeros(1)
        dist.reduce_scatter(t, [torch.full((1,), float(rank + i)) for i in range(size)], group=group)
        out["reduce_scatter"] = t.tolist()
        t = torch.zeros(2)
        dist.reduce_scatter_tensor(t, torch.arange(2.0 * size) + rank, group=group)
        out["reduce_scatter_tensor"] = t.tolist()
        t = torch.tensor([float(rank + 1)])
        dist.reduce(t, 0, group=group)
        out["reduce"] = t.tolist() if rank == 0 else None
        dist.barrier(group=group)
        seen[name] = out
    t = torch.tensor([1.0, 3.0]) * (rank + 1)  # NCCL's AVG, which gloo lacks: a sum divided by the size
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    seen["relay"]["avg"] = t.tolist()
    seen["backend"] = str(dist.get_backend())
    dist.destroy_process_group()
    return seen


@pytest.mark.slow  # two ranks, every collective twice (~7 s); the fast tier keeps the refusals
@pytest.mark.multirank
def test_the_relay_gives_gloos_results_on_two_ranks():
    results = run_ranks(collectives_through, 2, args=("relaytest",), timeout=120)
    assert all(r.ok for r in results), [r.output[-3000:] for r in results]
    for r in results:
        relay, gloo = r.result["relay"], r.result["gloo"]
        assert relay.pop("avg") == [1.5, 4.5]
        assert relay == gloo, (relay, gloo)
        assert r.result["backend"] == "relaytest"
    assert results[0].result["gloo"]["all_reduce"] == [3.0, 6.0]
    assert results[1].result["gloo"]["reduce_scatter_tensor"] == [5.0, 7.0]  # ranks 0 and 1 summed, second half


def cpu_tensor_on_the_cuda_group(check_removed):
    """All-reduce a CPU tensor on the mode's CUDA-only group (its stand-in for a bare ``nccl`` group)."""
    import torch.distributed as dist
    if check_removed:
        host_relay.refuse_unserved = lambda tensors, served: None
    dist.init_process_group(host_relay.relayed_backend("nccl"))
    t = torch.ones(2)
    try:
        dist.all_reduce(t)
        return t.tolist()
    except RuntimeError as exc:
        return f"refused: {exc}"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two launches of two ranks (~10 s); the fast tier keeps the refusal's own test below
@pytest.mark.multirank
def test_a_cpu_tensor_on_the_cuda_group_is_refused_as_nccl_refuses_it():
    refused = run_ranks(cpu_tensor_on_the_cuda_group, 2, args=(False,), timeout=120)
    for r in refused:
        assert r.ok and r.result.startswith("refused: No backend type associated with device type cpu"), \
            r.output[-3000:]
    # the refusal is the relay's own check: without it the relay carries the CPU tensor and hides the bug
    carried = run_ranks(cpu_tensor_on_the_cuda_group, 2, args=(True,), timeout=120)
    assert [r.result for r in carried] == [[2.0, 2.0]] * 2, [r.output[-3000:] for r in carried]


def test_a_collective_on_two_devices_is_refused():
    with pytest.raises(RuntimeError, match="No backend type associated with device type meta"):
        host_relay.refuse_unserved([torch.zeros(1), torch.zeros(1, device="meta")], {"cpu", "cuda"})
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        host_relay.refuse_unserved([torch.zeros(1)], {"cuda"})
    host_relay.refuse_unserved([torch.zeros(1), torch.zeros(1)], {"cpu", "cuda"})


def test_the_mode_puts_the_relay_in_nccls_place(monkeypatch):
    monkeypatch.setenv("SAT_PATCHES_SHARED_GPU", "1")
    assert process_group_backend("nccl") == host_relay.NAME  # CPU ranks too: the run passes through the relay
    assert process_group_backend("cpu:gloo,cuda:nccl") == host_relay.NAME
    assert host_relay.relayed_backend("nccl") == host_relay.CUDA_ONLY
    assert process_group_backend("gloo") == "gloo"
    monkeypatch.setenv("SAT_PATCHES_SHARED_GPU", "0")
    assert process_group_backend("nccl") == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


def simulate_gpus(monkeypatch, count, ranks_on_node, local_rank):
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(count))))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_on_node))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_ranks_share_the_gpu_only_in_the_mode(monkeypatch):
    simulate_gpus(monkeypatch, count=1, ranks_on_node=2, local_rank=1)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 but .* SAT_PATCHES_SHARED_GPU=1"):
        devices.compute_device()
    monkeypatch.setenv("SAT_PATCHES_SHARED_GPU", "1")
    assert devices.compute_device() == torch.device("cuda", 0)
    assert devices.compute_device().index == 0


@pytest.mark.parametrize("count, ranks_on_node", [(2, 2), (4, 2)])
def test_the_mode_is_refused_where_each_rank_has_its_own_card(monkeypatch, count, ranks_on_node):
    simulate_gpus(monkeypatch, count=count, ranks_on_node=ranks_on_node, local_rank=0)
    monkeypatch.setenv("SAT_PATCHES_SHARED_GPU", "1")
    with pytest.raises(RuntimeError, match=rf"SAT_PATCHES_SHARED_GPU=1 .* runs {ranks_on_node} rank\(s\) and .* "
                                           rf"sees {count} CUDA device\(s\).*each rank has a card of its own.*Unset"):
        devices.compute_device()


def test_get_args_names_the_shared_gpu_to_sat_and_deepspeed(monkeypatch):
    """SAT's get_args sets ``args.device`` to LOCAL_RANK and refuses anything else; on a shared GPU rank 1
    computes on cuda:0."""
    import argparse
    from sat_patches.runtime.distributed import get_args_on_compute_device
    simulate_gpus(monkeypatch, count=1, ranks_on_node=2, local_rank=1)
    monkeypatch.setenv("SAT_PATCHES_SHARED_GPU", "1")

    def sat_get_args(args_list, parser):  # the part of SAT's get_args that checks the device
        parser.add_argument("--local_rank", type=int, default=None)
        parser.add_argument("--device", type=int, default=-1)
        args = parser.parse_args(args_list)
        if args.device == -1:
            args.device = args.local_rank = 1
        if args.local_rank != args.device:
            raise ValueError("LOCAL_RANK (default 0) and args.device inconsistent")
        return args

    args = get_args_on_compute_device(sat_get_args, [], argparse.ArgumentParser())
    assert (args.device, args.local_rank, args.device_rank) == (0, 1, 0)


@pytest.mark.parametrize("raw, value", [("1", True), ("0", False), ("", False)])
def test_the_switch_reads_1_or_0(raw, value):
    assert settings.read("SAT_PATCHES_SHARED_GPU", {"SAT_PATCHES_SHARED_GPU": raw}) is value


@pytest.mark.parametrize("raw", ["true", "yes", "on", "2"])
def test_the_switch_refuses_anything_else(raw):
    with pytest.raises(settings.SettingError, match=r"SAT_PATCHES_SHARED_GPU=.*set it to 1 .* or 0"):
        settings.read("SAT_PATCHES_SHARED_GPU", {"SAT_PATCHES_SHARED_GPU": raw})

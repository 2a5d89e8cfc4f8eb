"""Part s of the GPU proof: two ranks sharing the card through the host relay (``SAT_PATCHES_SHARED_GPU=1``).

NCCL refuses two ranks on one device; in the shared-GPU debugging mode the process group's CUDA collectives go
through host copies over gloo (``sat_patches/runtime/host_relay.py``). On CPU ranks the tests prove the relay with
a relayed ``cpu`` device; here it carries real CUDA tensors: both ranks compute on ``cuda:0``, the collectives SAT and
DeepSpeed ZeRO-2 use give the expected sums, CPU tensors in the same group go to gloo, and a CPU tensor handed to
the CUDA-only group is refused as NCCL refuses it. Skipped, with the reason, where there is no CUDA.
"""
from __future__ import annotations

from proof_record import Recorder, require_cuda


def on_a_rank() -> dict:
    """One of two ranks on one card: what it computed on, and each collective's result."""
    import torch
    import torch.distributed as dist
    from sat_patches.runtime import devices, host_relay
    from sat_patches.runtime.distributed import process_group_backend
    device = devices.compute_device()
    torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend("nccl"))
    rank, size = dist.get_rank(), dist.get_world_size()
    seen = {"device": str(device), "backend": str(dist.get_backend())}
    t = torch.full((4,), rank + 1.0, device=device, dtype=torch.bfloat16)
    dist.all_reduce(t)
    seen["all_reduce (bf16)"] = t.float().tolist()
    flat = torch.empty(2 * size, device=device)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device=device))
    seen["all_gather_into_tensor"] = flat.tolist()
    part = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * size, device=device) + rank)
    seen["reduce_scatter_tensor"] = part.tolist()
    t = torch.full((2,), float(rank), device=device)
    dist.broadcast(t, 1)
    seen["broadcast"] = t.tolist()
    cpu = torch.full((2,), rank + 1.0)
    dist.all_reduce(cpu)
    seen["CPU all_reduce (gloo)"] = cpu.tolist()
    cuda_only = dist.new_group(backend=host_relay.relayed_backend("nccl"))
    try:
        dist.all_reduce(torch.ones(1), group=cuda_only)
        seen["CPU tensor on the CUDA-only group"] = "carried"
    except RuntimeError as exc:
        seen["CPU tensor on the CUDA-only group"] = str(exc).split(" (")[0]
    dist.barrier()
    dist.destroy_process_group()
    return seen


EXPECTED = {"device": "cuda:0", "backend": "hostrelay", "all_reduce (bf16)": [3.0] * 4,
            "all_gather_into_tensor": [0.0, 0.0, 1.0, 1.0], "broadcast": [1.0, 1.0],
            "CPU all_reduce (gloo)": [3.0, 3.0],
            "CPU tensor on the CUDA-only group": "No backend type associated with device type cpu"}
REDUCE_SCATTERED = {0: [1.0, 3.0], 1: [5.0, 7.0]}


def run(rec: Recorder, tiny: bool) -> None:
    from multirank import run_ranks
    with rec.check("2 ranks share one card (SAT_PATCHES_SHARED_GPU=1): the relay's collectives",
                   expected="cuda:0 on both, sums as NCCL's, CPU tensor refused on the CUDA-only group") as row:
        require_cuda()
        results = run_ranks("proof_shared:on_a_rank", 2, timeout=120,
                            env={"SAT_PATCHES_SHARED_GPU": "1", "CUDA_VISIBLE_DEVICES": "0"})
        failed = [r for r in results if not r.ok]
        assert not failed, failed[0].exception or failed[0].output[-2000:]
        for r in results:
            want = dict(EXPECTED, reduce_scatter_tensor=REDUCE_SCATTERED[r.rank])
            wrong = {k: (r.result.get(k), v) for k, v in want.items() if r.result.get(k) != v}
            assert not wrong, f"rank {r.rank}: (got, expected) {wrong}"
        row.measured = f"{results[0].result['device']} x 2 via {results[0].result['backend']}"

"""Two nodes of two ranks on this machine: four ranks started by two ``torchrun --nnodes 2 --nproc-per-node 2``
agents (``GROUP_RANK`` 0 and 1, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` per node; ``run_ranks(..., nodes=2)``) load
an MP=1 checkpoint at MP=2 (so MP=2 x DP=2).

Every rank checks SAT's node groups (its node's two ranks, source rank 0 or 2) and that it loaded its
own partition exactly, per node, without any tensor sent between ranks (``load_mp2`` of
``test_loading_mp``).
"""
import os

import pytest

from multirank import run_ranks

pytestmark = pytest.mark.multirank


def worker(ckpt_dir):
    from test_loading_mp import load_mp2
    from sat.mpu.initialize import get_node_group, get_node_src_rank, get_node_world_size
    import torch.distributed as dist
    got = load_mp2(ckpt_dir)
    got.update(group_rank=int(os.environ["GROUP_RANK"]), local_world_size=os.environ["LOCAL_WORLD_SIZE"],
               node_world_size=get_node_world_size(), node_src_rank=get_node_src_rank(),
               node_members=sorted(dist.get_process_group_ranks(get_node_group())))
    dist.barrier()
    return got


@pytest.mark.slow
def test_two_nodes_load_mp2_per_node(tmp_path):
    results = run_ranks(worker, 4, args=(str(tmp_path / "ckpt"),), nodes=2, timeout=240)
    assert all(r.ok for r in results), "\n".join(f"rank {r.rank}: {r.exception or ''}{r.output[-2000:]}"
                                                 for r in results)
    for rank, got in enumerate(r.result for r in results):
        node = got["group_rank"]
        assert node == rank // 2 and got["local_world_size"] == "2", got
        assert got["node_world_size"] == 2 and got["node_src_rank"] == 2 * node, got
        assert got["node_members"] == [2 * node, 2 * node + 1], got
        assert got["mp"] == 2 and got["mismatched"] == [] and got["param_diff"] == 0.0, got
        assert got["logit_diff"] < 1e-5 and got["sent"] == [] and got["args_changed"] == [], got


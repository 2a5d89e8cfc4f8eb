"""Two nodes of two ranks on this machine: four ranks in the environment two ``torchrun --nnodes 2
--nproc-per-node 2`` agents give their workers (``GROUP_RANK`` 0 and 1, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
per node; ``run_ranks(..., nodes=2)``) load an MP=1 checkpoint at MP=2 (so MP=2 x DP=2).

Every rank checks SAT's node groups (its node's two ranks, source rank 0 or 2) and that it loaded its
own partition exactly, per node, without any tensor sent between ranks (``load_mp2`` of
``test_loading_mp``). The ranks are forked, not started by two real agents: what the loading code reads of the
launcher is these variables, and torchrun's own rendezvous is not this project's code.
"""
import os

import pytest

from sat_patches.testing import run_ranks

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


def test_the_node_variables_are_torchruns_for_two_nodes_of_two():
    from sat_patches.testing import multirank
    envs = [multirank._rank_env(rank, 4, 1234, True, None, nodes=2) for rank in range(4)]
    picked = [{k: e[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                                 "ROLE_RANK", "WORLD_SIZE")} for e in envs]
    assert picked == [{"RANK": str(r), "LOCAL_RANK": str(r % 2), "GROUP_RANK": str(r // 2), "LOCAL_WORLD_SIZE": "2",
                       "GROUP_WORLD_SIZE": "2", "ROLE_RANK": str(r), "WORLD_SIZE": "4"} for r in range(4)]
    assert "GROUP_RANK" not in multirank._rank_env(0, 2, 1234, True, None)  # one node: as before
    with pytest.raises(ValueError, match="3 ranks do not split evenly over 2 node"):
        multirank._rank_env(0, 3, 1234, True, None, nodes=2)

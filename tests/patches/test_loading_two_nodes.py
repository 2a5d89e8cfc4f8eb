"""Two nodes of two ranks on this machine: two ``torchrun`` agents (``--nnodes 2 --nproc-per-node 2``,
c10d rendezvous on loopback) load an MP=1 checkpoint at MP=2 (so MP=2 x DP=2).

Every rank checks SAT's node groups (its node's two ranks, source rank 0 or 2) and that it loaded its
own partition exactly, per node, without any tensor sent between ranks (``load_mp2`` of
``test_loading_mp``). The file is also the worker torchrun starts.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sat_patches.testing import free_port

pytestmark = pytest.mark.multirank


def worker(ckpt_dir, out_dir):
    import sat_patches  # noqa: F401  (before sat)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_loading_mp import load_mp2
    from sat.mpu.initialize import get_node_group, get_node_src_rank, get_node_world_size
    import torch.distributed as dist
    got = load_mp2(ckpt_dir)
    got.update(group_rank=int(os.environ["GROUP_RANK"]), local_world_size=os.environ["LOCAL_WORLD_SIZE"],
               node_world_size=get_node_world_size(), node_src_rank=get_node_src_rank(),
               node_members=sorted(dist.get_process_group_ranks(get_node_group())))
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(got, f)
    dist.barrier()


@pytest.mark.slow
def test_two_nodes_load_mp2_per_node(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
           "--max-restarts", "0", os.path.abspath(__file__), str(tmp_path / "ckpt"), str(tmp_path)]
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = [subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
              for log in logs]
    deadline = time.monotonic() + 240
    try:  # an agent that fails ends the test at once (its peer would wait in the rendezvous or a collective)
        while (any(a.poll() is None for a in agents) and all(a.poll() in (None, 0) for a in agents)
               and time.monotonic() < deadline):
            time.sleep(0.2)
    finally:
        for a in agents:  # each agent with its workers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    outputs = "\n".join(f"agent {i} (exit {a.returncode}):\n" + log.read_text()[-3000:]
                        for i, (a, log) in enumerate(zip(agents, logs)))
    assert all(a.returncode == 0 for a in agents), outputs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, got in enumerate(ranks):
        node = got["group_rank"]
        assert node == rank // 2 and got["local_world_size"] == "2", got
        assert got["node_world_size"] == 2 and got["node_src_rank"] == 2 * node, got
        assert got["node_members"] == [2 * node, 2 * node + 1], got
        assert got["mp"] == 2 and got["mismatched"] == [] and got["param_diff"] == 0.0, got
        assert got["logit_diff"] < 1e-5 and got["sent"] == [] and got["args_changed"] == [], got


if __name__ == "__main__":
    worker(*sys.argv[1:3])
    from sat_patches.cli import exit_after_script  # the exit the finetune scripts' ranks take (sat_patches.launch)
    exit_after_script()

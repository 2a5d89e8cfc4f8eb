"""A rank SIGKILLed mid-step: 3 CPU ranks of the tiny LoRA SAT run; rank 1 kills itself
in its 3rd forward step. Every survivor ends non-zero within the bound, and its message names rank 1.

Also runnable as a script (what each rank runs): ``tests/patches/test_faults.py <tiny_lora args>`` with
``KILL_RANK``/``KILL_STEP`` set.
"""
import os
import re
import signal
import sys
import time

import pytest

from sat_patches.diagnostics import watchdog as hangs

HERE = os.path.abspath(__file__)
HEARTBEAT = 3
ARGS = ["--train-iters", "40", "--lora-rank", "2"]


def _kill_in_step_hook():
    import tiny_lora
    rank, step = os.environ.get("KILL_RANK"), int(os.environ.get("KILL_STEP", "0"))
    if rank is None or os.environ["RANK"] != rank:
        return
    original, calls = tiny_lora.forward_step, [0]

    def forward_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            print(f"KILLING rank {rank} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)
    tiny_lora.forward_step = forward_step


def _run(patches):
    from multirank import run_script
    start = time.monotonic()
    # one rank a node, as on a cluster: no launcher ends the survivors for them, they must notice the dead rank
    results = run_script([HERE, *ARGS], nranks=3, nodes=3, timeout=120, patches=patches,
                         env={"KILL_RANK": "1", "KILL_STEP": "3", "SAT_PATCHES_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
                              "SAT_PATCHES_COLLECTIVE_TIMEOUT": "60"})
    return results, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.multirank
def test_killed_rank_is_named_by_survivors():
    results, elapsed = _run(patches=True)
    assert "KILLING rank 1" in results[1].output and results[1].returncode == -signal.SIGKILL
    killed = float(re.search(r"KILLING rank 1 at ([\d.]+)", results[1].output).group(1))
    for r in (results[0], results[2]):
        assert not r.timed_out, r.output[-3000:]
        assert r.returncode not in (0, None), r.output[-3000:]
        assert r.returncode == hangs.EXIT_CODE, r.output[-3000:]
        assert "rank 1 stopped (no heartbeat for" in r.output, r.output[-3000:]
        noticed = float(re.search(r"sat_patches: rank \d \(pid \d+\) at ([\d.]+):", r.output).group(1))
        assert noticed - killed < HEARTBEAT + 5, (noticed, killed)
    assert elapsed < 90


@pytest.mark.slow  # end to end on CPU ranks (over 10 s)
@pytest.mark.multirank
def test_without_heartbeat_survivors_do_not_name_the_dead_rank():
    results, _ = _run(patches=["rank_heartbeat"])
    assert "KILLING rank 1" in results[1].output
    for r in (results[0], results[2]):
        assert "rank 1 stopped" not in r.output


def test_heartbeat_names_silent_peer_and_ignores_finished_one():
    """The watcher alone, on a local TCPStore: a peer that stops beating is named; one that finished
    training_main, one that never started (still preprocessing) and beating ones are not."""
    import datetime
    import torch.distributed as dist
    from sat_patches.diagnostics.heartbeat import Heartbeat
    from sat_patches.core.ports import free_port
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=5))
    me, finished, silent, _never_started = (Heartbeat(store, r, 4, timeout=0.5) for r in range(4))
    silent.beat(), finished.beat(), me.beat()
    finished.done()
    assert me.dead() is None                # first sight of each counter
    time.sleep(0.7)
    assert me.dead().startswith("rank 2 stopped (no heartbeat for")   # not 1 (done), not 3 (never beat)
    other = Heartbeat(store, 3, 4, timeout=0.5)
    assert other.dead() is None
    silent.beat(), me.beat()
    time.sleep(0.3)
    silent.beat(), me.beat()
    assert other.dead() is None             # beating peers are alive

def test_only_a_lost_connection_waits_to_name_a_dead_peer():
    import torch.distributed as dist
    from sat_patches.core.coordination import PEER_LOST, error_kinds

    def _lost_peer(exc):  # what training_main_with_heartbeat waits a few beats on
        return PEER_LOST in error_kinds(exc)
    assert _lost_peer(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                   "[127.0.0.1]:4321"))
    assert _lost_peer(dist.DistNetworkError("failed to recv, got 0 bytes"))
    assert not _lost_peer(ValueError("image folder is empty"))
    assert not _lost_peer(RuntimeError("No backend type associated with device type cpu\nsat_patches: ... Create the "
                                       "group with backend 'cpu:gloo,cuda:nccl'"))   # sat_patches' explanation


if __name__ == "__main__":
    _kill_in_step_hook()
    from tiny_lora import main
    sys.exit(main(sys.argv[1:]))

"""Atomic checkpoint saves: a tiny LoRA run at MP=2 on 2 CPU ranks saves iteration 2,
then rank 1 is SIGKILLed half-way through writing its shard of iteration 4. With the patch, ``latest``
still names 2 and iteration 2 loads; with stock SAT, ``latest`` names the half-written iteration 4.

Also runnable as a script (what each rank runs): ``tests/patches/test_checkpointing.py <tiny_lora args>`` with
``CRASH_RANK``/``CRASH_SAVE`` set kills that rank in its CRASH_SAVE-th shard write.
"""
import glob
import os
import signal
import sys

import pytest

HERE = os.path.abspath(__file__)
ARGS = ["--model-parallel-size", "2", "--train-iters", "4", "--save-interval", "2", "--no-save-rng",
        "--lora-rank", "2"]


def _crash_in_save_hook():
    """Rank CRASH_RANK writes half of its CRASH_SAVE-th ``mp_rank_*`` file, then SIGKILLs itself."""
    import torch
    if os.environ.get("EMA_CHECK_SHIM"):
        # stock SAT's save reads optimizer.optimizer (absent on a bare AdamW; the patch handles it)
        torch.optim.AdamW.optimizer = None
    rank, nth = os.environ.get("CRASH_RANK"), int(os.environ.get("CRASH_SAVE", "0"))
    if rank is None or os.environ["RANK"] != rank:
        return
    original, calls = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and os.path.basename(str(f)).startswith("mp_rank_"):
            calls[0] += 1
            if calls[0] == nth:
                original(obj, f, *args, **kwargs)
                size = os.path.getsize(f)
                with open(f, "r+b") as fh:       # as if killed part-way through the write
                    fh.truncate(size // 2)
                print(f"CRASHING rank {rank} in save of {f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return original(obj, f, *args, **kwargs)
    torch.save = save


def _run(tmp_path, patches, env=()):
    from multirank import run_script
    save = str(tmp_path / "ckpt")
    # a node per rank: torchrun would end the survivor of its own node with SIGTERM when rank 1 dies; on another
    # node it runs on and must notice the loss itself, as on a real multi-node job
    results = run_script([HERE, *ARGS, "--save", save], nranks=2, nodes=2, timeout=150, patches=patches,
                         env={"CRASH_RANK": "1", "CRASH_SAVE": "2", "SAT_PATCHES_COLLECTIVE_TIMEOUT": "20",
                              "SAT_PATCHES_HEARTBEAT_TIMEOUT": "5", **dict(env)})
    runs = glob.glob(os.path.join(save, "*", "latest"))
    assert len(runs) == 1, (runs, [r.output[-3000:] for r in results])
    assert "CRASHING rank 1" in results[1].output, results[1].output[-3000:]
    assert all(not r.timed_out for r in results)
    return os.path.dirname(runs[0]), results


@pytest.mark.slow
@pytest.mark.multirank
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    from sat_patches.checkpoints.loading import find_checkpoint, read_model_config
    run, results = _run(tmp_path, patches=True)
    with open(os.path.join(run, "latest")) as f:
        assert f.read().strip() == "2"
    ckpt = find_checkpoint(run)
    assert ckpt.iteration == 2 and ckpt.mp_size == 2
    for shard in range(2):
        sd = ckpt.open(shard)
        assert sd["iteration"] == 2
        assert any("matrix_A" in k for k in sd["module"]) and any("matrix_B" in k for k in sd["module"])
    assert read_model_config(run)["model_parallel_size"] == 2
    assert not os.path.exists(os.path.join(run, "4"))          # the crashed save never appeared
    assert results[1].returncode != 0
    assert results[0].returncode != 0 and "rank 1 stopped (no heartbeat" in results[0].output   # survivor names it


@pytest.mark.slow
@pytest.mark.multirank
def test_crash_mid_save_stock_sat_loses_checkpoint(tmp_path):
    """Fails without the patch's effect: stock SAT points 'latest' at the half-written iteration."""
    from sat_patches.checkpoints.loading import CheckpointError, find_checkpoint
    run, _ = _run(tmp_path, patches=["atomic_checkpoint_save"], env={"EMA_CHECK_SHIM": "1"})
    with open(os.path.join(run, "latest")) as f:
        assert f.read().strip() == "4"
    with pytest.raises(CheckpointError):
        find_checkpoint(run)


def test_publish_replaces_existing_iteration_atomically(tmp_path):
    """Re-saving an existing iteration (SAT's final save) replaces the directory; latest written last."""
    import torch
    from sat_patches.checkpoints.saving import publish
    from sat_patches.checkpoints.loading import find_checkpoint
    save, staged = tmp_path / "run", tmp_path / "run" / ".saving-4"
    for d, value in ((save / "4", 1.0), (staged / "4", 2.0)):
        d.mkdir(parents=True)
        torch.save({"module": {"w": torch.tensor(value)}}, d / "mp_rank_00_model_states.pt")
    (save / "latest").write_text("4")
    (staged / "latest").write_text("4")
    (staged / "model_config.json").write_text('{"num_layers": 1}')
    publish(str(staged), str(save))
    assert float(find_checkpoint(str(save)).open(0)["module"]["w"]) == 2.0
    assert sorted(os.listdir(save)) == ["4", "latest", "model_config.json"]


def test_publish_refuses_incomplete_staging(tmp_path):
    import torch
    from sat_patches.checkpoints.saving import publish
    from sat_patches.checkpoints.loading import CheckpointError
    save, staged = tmp_path / "run", tmp_path / "run" / ".saving-4"
    (staged / "4").mkdir(parents=True)
    torch.save({"module": {}}, staged / "4" / "mp_rank_01_model_states.pt")   # shard 0 missing
    (staged / "latest").write_text("4")
    (save / "latest").write_text("2")
    with pytest.raises(CheckpointError, match="lacks model-parallel shard"):
        publish(str(staged), str(save))
    assert (save / "latest").read_text() == "2"


@pytest.mark.parametrize("lacking, message", [
    ("mp_rank_01_model_states.pt", "lacks model-parallel shard(s) [1] of 2 (model_config.json says model_parallel_size "
                                   "2): copy the missing mp_rank_01_model_states.pt"),
    ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "lacks bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt in "),
    ("truncated bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", "lacks bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"),
])
def test_publish_needs_every_shard_of_every_rank(tmp_path, lacking, message):
    """4 ranks at MP=2 (2 data-parallel): 2 model-state shards, 4 ZeRO optimizer shards; one missing (or
    cut short): nothing is published, the previous checkpoint stays the one 'latest' names."""
    import json
    import torch
    from sat_patches.checkpoints.saving import publish
    from sat_patches.checkpoints.loading import CheckpointError
    save, staged = tmp_path / "run", tmp_path / "run" / ".saving-4"
    (staged / "4").mkdir(parents=True)
    files = [f"mp_rank_{m:02d}_model_states.pt" for m in range(2)] + \
            [f"bf16_zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(2) for m in range(2)]
    for name in files:
        torch.save({"module": {}}, staged / "4" / name)
    (staged / "latest").write_text("4")
    (staged / "model_config.json").write_text(json.dumps({"num_layers": 1, "model_parallel_size": 2}))
    (save / "latest").write_text("2")
    what, _, name = lacking.rpartition(" ")
    if what == "truncated":
        data = (staged / "4" / name).read_bytes()
        (staged / "4" / name).write_bytes(data[: len(data) // 2])
    else:
        (staged / "4" / name).unlink()
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        publish(str(staged), str(save), world_size=4, mp_size=2)
    assert (save / "latest").read_text() == "2" and not (save / "4").exists()


def test_every_staged_file_and_directory_is_fsynced_before_the_rename_that_publishes_it(tmp_path, monkeypatch):
    import torch
    from sat_patches.checkpoints.saving import publish
    save, staged = tmp_path / "run", tmp_path / "run" / ".saving-4"
    (staged / "4").mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"module": {}}, staged / "4" / name)
    (staged / "latest").write_text("4")
    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a))), real_rename(a, b))[1])
    publish(str(staged), str(save))
    renamed = events.index(("rename", str(staged / "4")))
    synced = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert {str(staged / "4" / n) for n in os.listdir(save / "4")} | {str(staged / "4")} <= synced, events
    assert ("fsync", str(save)) in events[renamed:]  # the new entry in the run directory, too


if __name__ == "__main__":
    _crash_in_save_hook()
    from tiny_lora import main
    sys.exit(main(sys.argv[1:]))

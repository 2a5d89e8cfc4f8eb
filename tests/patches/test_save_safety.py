"""Saves that go wrong as they do for unlucky users: a full disk, two runs saving into one folder, a
symlink planted at a temporary name, an fsync that fails. 2 CPU ranks run the atomic save around a
stand-in for SAT's ``save_checkpoint`` (rank 0 writes the layout, every rank ends at a barrier)."""
import errno
import json
import os
import socket
import subprocess
import warnings

import pytest

from multirank import run_ranks

CONFIG = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 1024}


def _stand_in(fail: bool):
    import torch
    import torch.distributed as dist
    from sat_patches.checkpoints.writer import write_layout

    def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):
        if dist.get_rank() == 0:
            if fail:  # part of a shard written, then the disk is full
                os.makedirs(os.path.join(args.save, str(iteration)), exist_ok=True)
                with open(os.path.join(args.save, str(iteration), "mp_rank_00_model_states.pt"), "wb") as f:
                    f.write(b"PK" * 1000)
            else:
                write_layout(args.save, iteration, {0: {"module": {"w": torch.tensor(float(iteration))}}}, CONFIG)
        if fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        dist.barrier()
    return save_checkpoint


def _plant_lock(save, pid):
    with open(os.path.join(save, ".saving.lock"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": pid, "token": f"elsewhere-{pid}"}, f)


def _saves(save, live_pid, dead_pid):
    import argparse
    import torch.distributed as dist
    from sat import mpu
    from sat_patches.checkpoints.saving import save_checkpoint_staged
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1)
    rank, seen = dist.get_rank(), {}
    args = argparse.Namespace(save=save)

    def attempt(name, fail=False, iteration=4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                save_checkpoint_staged(_stand_in(fail), iteration, None, None, None, args)
                seen[name] = "saved"
            except (RuntimeError, OSError) as exc:
                seen[name] = f"{type(exc).__name__}: {exc}"
        seen[name] += " | " + " | ".join(str(w.message) for w in caught)
        dist.barrier()
        seen[name + " files"] = sorted(os.listdir(save))
        # every rank has looked before rank 0 starts the next save: it stages under the same name (same
        # iteration, same run), and a slower rank listed that new folder as one the failed save had left
        dist.barrier()

    if rank == 0:
        os.makedirs(os.path.join(save, ".saving-2", "2"))  # left by a save that crashed in an earlier run
        _plant_lock(save, live_pid)
    dist.barrier()
    attempt("second run")
    if rank == 0:
        _plant_lock(save, dead_pid)
    dist.barrier()
    attempt("disk full", fail=True)
    attempt("next save")
    with open(os.path.join(save, "latest")) as f:
        seen["latest"] = f.read()
    return seen


@pytest.mark.slow
@pytest.mark.multirank
def test_full_disk_leaves_no_staging_folder_a_second_live_run_is_refused_a_dead_ones_lock_taken_over(tmp_path):
    save = tmp_path / "run"
    save.mkdir()
    dead = subprocess.Popen(["true"])  # a process that has ended: its pid names no live run
    dead.wait()
    results = run_ranks(_saves, 2, args=(str(save), os.getpid(), dead.pid), timeout=120)
    for r in results:
        assert r.result, r.output[-3000:]
        seen = r.result
        # a live run holds the folder: refused on every rank, nothing written
        assert seen["second run"].startswith("CheckpointSaveError") and f"process {os.getpid()}" in seen["second run"]
        assert "give this run its own --save folder" in seen["second run"]
        assert seen["second run files"] == [".saving-2", ".saving.lock"]
        # the disk fills during the save: the error surfaces, the staging folder (and the stale one) are gone
        assert "No space left on device" in seen["disk full"], seen
        assert seen["disk full files"] == [".saving.lock"], seen
        # the next save succeeds
        assert seen["next save"].startswith("saved"), seen
        assert seen["next save files"] == [".saving.lock", "4", "latest", "model_config.json"], seen
        assert seen["latest"] == "4"
    assert f"held by process {dead.pid} on this host, which has ended" in results[0].result["disk full"]


def test_a_symlink_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    import torch
    from sat_patches.checkpoints import writer
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "latest"
    os.symlink(victim, f"{target}.tmp-{os.getpid()}")  # the name the writer used to use
    names = iter(["aaaa", "aaaa", "bbbb", "cccc"])
    monkeypatch.setattr(writer.secrets, "token_hex", lambda n: next(names))
    os.symlink(victim, f"{target}.tmp-{os.getpid()}-aaaa")  # and the name it will try first
    writer.write_text_atomic(str(target), "4")
    writer.save_atomic({"w": torch.ones(1)}, str(tmp_path / "shard.pt"))
    assert victim.read_text() == "keep me"
    assert target.read_text() == "4" and not target.is_symlink()
    assert torch.load(tmp_path / "shard.pt")["w"].item() == 1.0


def test_fsync_errors_are_errors(tmp_path, monkeypatch):
    from sat_patches.checkpoints import writer

    def fail(fd):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output error"):
        writer.fsync_dir(str(tmp_path))
    with pytest.raises(OSError, match="Input/output error"):
        writer.write_text_atomic(str(tmp_path / "latest"), "4")
    assert os.listdir(tmp_path) == []  # the temporary file is removed

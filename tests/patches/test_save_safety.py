"""Saves that go wrong as they do for unlucky users: a full disk, two runs saving into one folder, a
symlink planted at a temporary name, an fsync that fails. 2 CPU ranks run the atomic save around a
stand-in for SAT's ``save_checkpoint`` (rank 0 writes the layout, every rank ends at a barrier)."""
import errno
import os
import re
import subprocess
import sys
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


# another run's lock, held as save_lock holds it (the record written after the flock) until the process is killed
HOLDER = """import fcntl, json, os, socket, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
print("held", flush=True)
sys.stdin.read()
"""


def _saves(save):
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
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, os.path.join(save, ".saving.lock")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "held\n"
        seen["holder"] = holder.pid
    dist.barrier()
    attempt("second run")
    if rank == 0:  # the other run is killed: its lock goes with it, its record stays in the file
        holder.kill()
        holder.wait()
    dist.barrier()
    attempt("disk full", fail=True)
    attempt("next save")
    with open(os.path.join(save, "latest")) as f:
        seen["latest"] = f.read()
    return seen


@pytest.mark.slow
@pytest.mark.multirank
def test_full_disk_leaves_no_staging_folder_a_second_live_run_is_refused_a_killed_ones_lock_is_free(tmp_path):
    save = tmp_path / "run"
    save.mkdir()
    results = run_ranks(_saves, 2, args=(str(save),), timeout=120)
    holder = results[0].result["holder"]
    for r in results:
        assert r.result, r.output[-3000:]
        seen = r.result
        # a live run holds the folder: refused on every rank, naming the lock file and its holder, nothing written
        assert seen["second run"].startswith("CheckpointSaveError"), seen
        assert re.search(rf"process {holder} on host .*'{re.escape(str(save))}/.saving.lock'", seen["second run"])
        assert "give this run its own --save folder" in seen["second run"]
        assert seen["second run files"] == [".saving-2", ".saving.lock"]
        # the holder was killed: the lock is free (no warning); the disk fills during the save: the error
        # surfaces, the staging folder (and the stale one) are gone
        assert "No space left on device" in seen["disk full"] and seen["disk full"].endswith(" | "), seen
        assert seen["disk full files"] == [".saving.lock"], seen
        # the next save succeeds
        assert seen["next save"].startswith("saved"), seen
        assert seen["next save files"] == [".saving.lock", "4", "latest", "model_config.json"], seen
        assert seen["latest"] == "4"


def test_a_run_takes_its_folder_s_lock_once_and_keeps_it(tmp_path):
    from sat_patches.checkpoints import save_lock
    token = save_lock.acquire(str(tmp_path))
    assert save_lock.acquire(str(tmp_path)) == token  # its later saves
    record = (tmp_path / ".saving.lock").read_text()
    assert f'"pid": {os.getpid()}' in record and token in record
    other = subprocess.run([sys.executable, "-c", HOLDER.replace("LOCK_EX", "LOCK_EX | fcntl.LOCK_NB"),
                            str(tmp_path / ".saving.lock")], input="", capture_output=True, text=True)
    assert "BlockingIOError" in other.stderr  # another process cannot take it


def test_a_file_system_without_locks_saves_with_a_warning(tmp_path, monkeypatch):
    from sat_patches.checkpoints import save_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(save_lock.fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="cannot be locked .Function not implemented.: a second run saving"):
        assert save_lock.acquire(str(tmp_path)).endswith(f"-{os.getpid()}")


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

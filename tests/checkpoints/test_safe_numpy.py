"""Crafted numpy objects in a checkpoint: an object dtype flagged as holding no references would make numpy
read the file's bytes as pointers (a segmentation fault). Each load runs in a child process (a rank, or a
fresh interpreter where the load needs SAT's checkpoint code set up from scratch), so a crash fails the test
instead of ending pytest."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from sat_patches.checkpoints import safe_load
from multirank import run_ranks

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct


class CraftedDtype:
    """Pickles as ``numpy.dtype('O')`` with a saved state whose flags say: no references."""

    def __init__(self, code="O", flags=0):
        self.code, self.flags = code, flags

    def __reduce__(self):
        return np.dtype, (self.code, False, True), (3, "|", None, None, None, -1, -1, self.flags)


class CraftedArray:
    """Pickles as a numpy array of ``dtype`` whose data are the given bytes."""

    def __init__(self, dtype, data, shape):
        self.dtype, self.data, self.shape = dtype, data, shape

    def __reduce__(self):
        return _reconstruct, (np.ndarray, (0,), b"b"), (1, self.shape, self.dtype, False, self.data)


def crafted_rng_file(path, array):
    import expert_llama as el
    cfg = el.config(num_layers=1, hidden_size=32, inner_hidden_size=64)
    model = el.model_class()(el.build_args(cfg))
    el.write_checkpoint(model, cfg, str(path))
    shard = os.path.join(str(path), "1", "mp_rank_00_model_states.pt")
    state = torch.load(shard, weights_only=False)
    state["np_rng_state"] = ("MT19937", array, 624, 0, 0.0)
    torch.save(state, shard)
    return shard


def run_child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop(safe_load.TRUST_ENV, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)


POINTERS = CraftedArray(CraftedDtype(), b"\x41" * 16, (2,))


def load_in_a_rank(path: str) -> str:
    """(a rank, where a crash ends only the rank) ``safe_load.load`` of ``path``, as a user without the trust
    setting runs it: what came of it."""
    os.environ.pop(safe_load.TRUST_ENV, None)
    try:
        state = safe_load.load(path)
    except safe_load.UnsafeCheckpointError as exc:
        return f"REFUSED {exc}"
    return f"LOADED {state!r}"  # reads the pointers


@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
@pytest.mark.multirank
def test_object_dtype_file_is_refused_without_a_crash_through_safe_load(tmp_path):
    path = str(tmp_path / "crafted.pt")
    torch.save({"np_rng_state": ("MT19937", POINTERS, 0, 0, 0.0)}, path)
    [r] = run_ranks(load_in_a_rank, 1, args=(path,), timeout=120)
    assert r.ok, (r.returncode, r.exception or r.output[-3000:])
    assert r.result.startswith("REFUSED") and "numpy dtype 'O'" in r.result, r.result


@pytest.mark.slow
def test_object_dtype_rng_state_is_refused_without_a_crash_when_restored(tmp_path):
    crafted_rng_file(tmp_path / "ckpt", POINTERS)
    child = run_child(f"""
        import os
        os.environ.setdefault("WANDB_MODE", "disabled")
        import sat_patches; sat_patches.apply()
        from sat.training.model_io import load_checkpoint
        from sat_patches.checkpoints import safe_load
        from sat_patches.checkpoints.model_config import read_model_config
        import expert_llama as el
        args = el.build_args(read_model_config({str(tmp_path / 'ckpt')!r}))
        args.mode, args.no_load_rng = "pretrain", False
        model = el.model_class()(args)
        try:
            load_checkpoint(model, args, load_path={str(tmp_path / 'ckpt')!r})
        except safe_load.UnsafeCheckpointError as exc:
            print("REFUSED", exc)
        else:
            import numpy; print("RESTORED", numpy.random.get_state()[1][:2])
    """)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "REFUSED" in child.stdout and "numpy dtype 'O'" in child.stdout, child.stdout


@pytest.mark.parametrize("array, refused", [
    (CraftedArray(CraftedDtype("u4", flags=63), b"\0" * 8, (2,)), "saved fields, sizes or flags"),
    (CraftedArray(CraftedDtype("u4"), b"\0" * 7, (2,)), "with 7 bytes"),
    (CraftedArray(CraftedDtype("V8"), b"\0" * 8, (1,)), "numpy dtype 'V8'"),
    (CraftedArray(CraftedDtype("u4"), b"\0" * 8, (2 ** 40, 0, 2 ** 40)), "with 8 bytes"),
])
def test_other_crafted_numpy_states_are_refused(tmp_path, array, refused):
    path = str(tmp_path / "crafted.pt")
    torch.save({"a": array}, path)
    with pytest.raises(safe_load.UnsafeCheckpointError, match=refused):
        safe_load.load(path)


def test_a_real_rng_state_round_trips_as_plain_numpy(tmp_path):
    np.random.seed(5)
    state = np.random.get_state()
    torch.save({"np_rng_state": state, "arrays": [np.arange(6, dtype=">f8").reshape(2, 3, order="F")]},
               tmp_path / "s.pt")
    loaded = safe_load.load(str(tmp_path / "s.pt"))
    name, keys, pos, has_gauss, cached = loaded["np_rng_state"]
    assert type(keys) is np.ndarray and keys.dtype == np.uint32 and np.array_equal(keys, state[1])
    np.random.set_state(loaded["np_rng_state"])
    assert np.random.randint(1 << 30) == (np.random.seed(5), np.random.randint(1 << 30))[1]
    assert np.array_equal(loaded["arrays"][0], np.arange(6, dtype=">f8").reshape(2, 3, order="F"))

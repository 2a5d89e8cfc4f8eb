"""Stand-ins for CUDA-only modules: xformers' memory_efficient_attention in plain torch, served only in a process that
imported sat_patches and only where xformers is not installed."""
import math
import os
import subprocess
import sys

import pytest
import torch

import sat_patches

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(sat_patches.__file__)))


def reference_attention(q, k, v, bias=None, scale=None):
    """Attention written out, in xformers' [batch, tokens, heads, head_dim] layout."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bmhk,bnhk->bhmn", q, k) * scale
    if bias is not None:
        scores = scores + bias
    return torch.einsum("bhmn,bnhk->bmhk", scores.softmax(-1), v)


@pytest.mark.parametrize("scale, with_bias", [(None, False), (0.3, False), (None, True)])
def test_standin_matches_plain_attention_values_and_gradients(scale, with_bias):
    import xformers.ops as xops
    assert getattr(xops, "__sat_patches__", None) == "xformers_standin"  # no real xformers on this machine
    torch.manual_seed(0)
    shape = (2, 7, 3, 8)  # batch, tokens, heads, head_dim
    inputs = [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    bias = torch.randn(2, 3, 7, 7, dtype=torch.float64) if with_bias else None
    ours = xops.memory_efficient_attention(*inputs, attn_bias=bias, scale=scale)
    grads = torch.autograd.grad(ours.square().sum(), inputs)
    ref = reference_attention(*inputs, bias=bias, scale=scale)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    assert ours.shape == shape
    torch.testing.assert_close(ours, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def _import_xformers(tmp_path, env=None, fake_real=False, ours=True):
    if fake_real:  # a "real" xformers on the path must win over the stand-in
        (tmp_path / "xformers").mkdir()
        (tmp_path / "xformers" / "__init__.py").write_text("REAL = True\n")
    code = ("import importlib.util, sys\n"
            + ("import sat_patches\n" if ours else "print('SPEC', importlib.util.find_spec('xformers'))\n")
            + "import xformers; print('GOT', getattr(xformers, '__sat_patches__', 'real'))")
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), SOURCE]), **(env or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)


@pytest.mark.slow  # four fresh interpreters (~4 s)
def test_served_only_after_import_sat_patches_never_over_a_real_xformers_and_off_when_disabled(tmp_path):
    served = _import_xformers(tmp_path)
    assert "GOT xformers_standin" in served.stdout, served.stderr[-2000:]
    elsewhere = _import_xformers(tmp_path, ours=False)  # sat_patches on the path, not imported: nothing served
    assert "SPEC None" in elsewhere.stdout and "No module named 'xformers'" in elsewhere.stderr, elsewhere.stderr
    disabled = _import_xformers(tmp_path, env={"SAT_PATCHES_DISABLE": "xformers_standin"})
    assert "No module named 'xformers'" in disabled.stderr
    real = _import_xformers(tmp_path, fake_real=True)
    assert "GOT real" in real.stdout, real.stderr[-2000:]


def test_listed_in_status_and_unpatched_like_any_patch():
    row = {r["name"]: r for r in sat_patches.status()}["xformers_standin"]
    assert row["status"] == "applied" and "memory_efficient_attention" in row["answers"]
    sat_patches.unpatch("xformers_standin")
    try:
        assert "xformers" not in sys.modules
    finally:
        sat_patches.apply()
    assert sat_patches.is_patched("xformers_standin")

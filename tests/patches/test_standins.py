"""Stand-ins for CUDA-only modules: xformers' memory_efficient_attention in plain torch; the libraries SAT imports at
``import sat`` and a fine-tune never uses, imported at their first use."""
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


def _import_xformers(tmp_path, env=None, fake_real=False):
    if fake_real:  # a "real" xformers on the path must win over the stand-in
        (tmp_path / "xformers").mkdir()
        (tmp_path / "xformers" / "__init__.py").write_text("REAL = True\n")
    code = "import xformers; print('GOT', getattr(xformers, '__sat_patches__', 'real'))"
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), SOURCE]), **(env or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)


@pytest.mark.slow  # three fresh interpreters (~6 s)
def test_served_at_start_up_never_over_a_real_xformers_and_off_when_disabled(tmp_path):
    served = _import_xformers(tmp_path)
    assert "GOT xformers_standin" in served.stdout, served.stderr[-2000:]
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


DEFERRED_RUN = r"""
import importlib, json, sys
import sat_patches, sat
held = [m for m in ("wandb", "datasets", "transformers.activations", "requests") if m in sys.modules]
import torch
import sat.data_utils.hf_dataset as hf, sat.model.official.gpt2_model as gpt2, sat.training.deepspeed_training as dt
x = torch.linspace(-3, 3, 7)
first = gpt2.gelu(x)                       # SAT's GPT-2 activation, bound at import as ACT2FN["gelu_new"]
from transformers.activations import NewGELUActivation
rows = dict(held=held, repr=repr(hf.load_dataset), same=bool(torch.equal(first, NewGELUActivation()(x))),
            wandb=dt.wandb.log.__module__.split(".")[0], datasets_unused="datasets" in sys.modules)
sat_patches.unpatch("deferred_imports")    # SAT's module imported again, as stock SAT imports it
del sys.modules["sat.data_utils.hf_dataset"]
importlib.import_module("sat.data_utils.hf_dataset")
rows["datasets_stock"] = "datasets" in sys.modules
print(json.dumps(rows))
"""


@pytest.mark.slow  # a fresh interpreter importing SAT (~10 s); the registry's fast tests list the record
def test_libraries_sat_imports_but_a_fine_tune_never_uses_are_imported_at_first_use():
    """After ``import sat`` none of wandb, datasets, transformers.activations, requests is imported; what SAT bound from
    them works as the real objects at first use; without the patch SAT's module imports its library."""
    import json
    run = subprocess.run([sys.executable, "-c", DEFERRED_RUN], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert rows["held"] == [] and rows["datasets_unused"] is False, rows
    assert rows["repr"] == "<deferred datasets.load_dataset>" and rows["same"] and rows["wandb"] == "wandb", rows
    assert rows["datasets_stock"] is True, rows
    assert {r["name"]: r for r in sat_patches.status()}["deferred_imports"]["status"] == "applied"


def test_a_deferred_library_is_bound_as_placeholders_and_imported_at_first_use(monkeypatch):
    """The placeholders of ``_sat_patches_deferred`` on a library of the standard library (``fractions``, taken out
    of ``sys.modules`` for the test): names bound while the module's code runs import nothing; a value used while it
    runs, or after, is the real one; nothing of the placeholder stays in ``sys.modules``."""
    import _sat_patches_deferred as deferred
    monkeypatch.delitem(sys.modules, "fractions", raising=False)
    monkeypatch.setitem(deferred.DEFERRED, "a_sat_module", ("fractions",))
    with deferred.binding_names("a_sat_module"):
        import fractions
        from fractions import Fraction
        half = Fraction(1, 2)                      # used while the module's code runs: imported then
        assert "fractions" in sys.modules and not isinstance(sys.modules["fractions"], deferred.DeferredModule)
    assert half == 0.5 and repr(Fraction) == "<deferred fractions.Fraction>"
    monkeypatch.delitem(sys.modules, "fractions")
    with deferred.binding_names("a_sat_module"):
        from fractions import Fraction as later
        third = later  # bound, not used
    assert "fractions" not in sys.modules and isinstance(fractions, deferred.DeferredModule)
    assert third(1, 3) * 3 == 1 and "fractions" in sys.modules  # first use after the module's code: imported

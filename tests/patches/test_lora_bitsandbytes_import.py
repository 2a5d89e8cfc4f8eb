"""sat_patches.lora.bitsandbytes_import and the patch ``bitsandbytes_compile_on_first_call``: bitsandbytes comes in
without torch's compiler, which its NF4 kernels import on their first call instead, with the same results, whoever
imports SAT's LoRA first (one of our own modules while the patches wait for it, in the case below)."""
import os
import subprocess
import sys

import pytest

from sat_patches.runtime.compiler import compile_on_first_call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = """
import sys
import sat_patches.cogvlm.trainer  # imports SAT, then SAT's LoRA (which imports bitsandbytes) before the patches apply
import torch
from sat_patches.runtime.construction import build_on
with build_on("meta"):  # as a rank builds its model before loading: torch's meta normal_ would import the compiler
    torch.nn.Embedding(64, 8)
import bitsandbytes.functional as F
print("compiler before a kernel ran:", "torch._dynamo" in sys.modules, "torch._inductor.compile_fx" in sys.modules)
w = torch.linspace(-3, 3, 64 * 64).reshape(64, 64).sin() * 2
q, state = F.quantize_4bit(w, quant_type="nf4", blocksize=64)
torch.save(F.dequantize_4bit(q, state), sys.argv[1])
print("compiler after:", "torch._dynamo" in sys.modules)
"""


@pytest.mark.slow
def test_the_nf4_kernels_compile_on_first_call_with_the_results_of_an_eager_import(tmp_path):
    import torch
    said = {}
    for disabled in ("", "bitsandbytes_compile_on_first_call"):  # the patch, and bitsandbytes as it imports itself
        env = dict(os.environ, PYTHONPATH=ROOT, TORCH_COMPILE_DISABLE="1", SAT_PATCHES_DISABLE=disabled)  # eager
        out = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / f"{disabled or 'patched'}.pt")],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        said[disabled or "patched"] = out.stdout
    assert "compiler before a kernel ran: False False" in said["patched"]
    assert "compiler before a kernel ran: True True" in said["bitsandbytes_compile_on_first_call"]
    assert all("compiler after: True" in s for s in said.values())  # compiled (or tried) on the first call
    assert torch.equal(torch.load(tmp_path / "patched.pt"),
                       torch.load(tmp_path / "bitsandbytes_compile_on_first_call.pt"))


def test_a_deferred_function_is_compiled_once_on_its_first_call_with_the_same_arguments():
    calls = []

    def compile_now(model, **kwargs):
        calls.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    def kernel(x, scale=1):
        return x * scale
    deferred = compile_on_first_call(compile_now)
    wrapped = deferred(kernel, dynamic=False)
    also = deferred(dynamic=False)(kernel)  # @torch.compile(dynamic=False)
    assert calls == [] and wrapped.__wrapped__ is kernel and wrapped.__name__ == "kernel"
    assert wrapped(2, scale=3) == ("compiled", 6) and wrapped(1) == ("compiled", 1)
    assert calls == [(kernel, {"dynamic": False})]  # once
    assert also(4) == ("compiled", 4) and len(calls) == 2
    module = object()  # not a plain function: compiled at once, as before
    deferred(module)
    assert calls[-1] == (module, {})


def test_the_hook_runs_before_the_modules_own_code_at_each_import_until_removed(monkeypatch):
    """:class:`BeforeImport` on a module of the standard library (``fractions``, taken out of ``sys.modules``):
    the callback sees the module before its code ran, once per import."""
    from sat_patches.core.after_import import BeforeImport
    seen = []
    hook = BeforeImport("fractions", lambda: seen.append(hasattr(sys.modules.get("fractions"), "Fraction")))
    monkeypatch.delitem(sys.modules, "fractions", raising=False)
    hook.arm()
    try:
        import fractions
        assert seen == [False] and hook.calls == 1 and fractions.Fraction(1, 2) * 2 == 1
        del sys.modules["fractions"]
        import fractions  # noqa: F811  (imported afresh: the hook runs again)
        assert seen == [False, False] and hook.calls == 2
    finally:
        hook.remove()
    del sys.modules["fractions"]
    import fractions  # noqa: F401,F811
    assert hook.calls == 2 and not hook.is_armed()


def test_the_patch_is_armed_at_import_and_says_whether_it_came_in_time():
    import sat_patches
    from sat_patches.core.module_patches import BITSANDBYTES_BEFORE_LORA, BITSANDBYTES_PATCH
    [row] = [r for r in sat_patches.status() if r["name"] == BITSANDBYTES_PATCH]
    assert BITSANDBYTES_BEFORE_LORA.is_armed() and row["status"] == "applied", row
    sat_patches.unpatch(BITSANDBYTES_PATCH)
    try:
        assert not BITSANDBYTES_BEFORE_LORA.is_armed()
    finally:
        sat_patches.apply()
    assert BITSANDBYTES_BEFORE_LORA.is_armed()

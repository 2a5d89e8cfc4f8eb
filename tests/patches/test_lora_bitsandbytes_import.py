"""sat_patches.lora.bitsandbytes_import: bitsandbytes comes in without torch's compiler, which its NF4 kernels import
on their first call instead, with the same results."""
import os
import subprocess
import sys

import pytest

from sat_patches.lora.bitsandbytes_import import compile_on_first_call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = """
import sys
if sys.argv[1] == "bitsandbytes-alone":  # the reference: bitsandbytes as it imports itself
    import bitsandbytes
else:
    import sat_patches, sat
    import sat.model.finetune.lora2  # SAT's LoRA, which imports bitsandbytes
import torch
import bitsandbytes.functional as F
print("compiler before a kernel ran:", "torch._dynamo" in sys.modules, "torch._inductor.compile_fx" in sys.modules)
w = torch.linspace(-3, 3, 64 * 64).reshape(64, 64).sin() * 2
q, state = F.quantize_4bit(w, quant_type="nf4", blocksize=64)
torch.save(F.dequantize_4bit(q, state), sys.argv[2])
print("compiler after:", "torch._dynamo" in sys.modules)
"""


@pytest.mark.slow
def test_the_nf4_kernels_compile_on_first_call_with_the_results_of_an_eager_import(tmp_path):
    import torch
    said = {}
    for order in ("sat_patches-first", "bitsandbytes-alone"):
        out = subprocess.run([sys.executable, "-c", PROGRAM, order, str(tmp_path / f"{order}.pt")], capture_output=True,
                             text=True, timeout=300, cwd=tmp_path,
                             env=dict(os.environ, PYTHONPATH=ROOT, TORCH_COMPILE_DISABLE="1"))  # no C++ build: eager
        assert out.returncode == 0, out.stderr[-3000:]
        said[order] = out.stdout
    assert "compiler before a kernel ran: False False" in said["sat_patches-first"]
    assert "compiler before a kernel ran: True True" in said["bitsandbytes-alone"]
    assert all("compiler after: True" in s for s in said.values())  # compiled (or tried) on the first call
    assert torch.equal(torch.load(tmp_path / "sat_patches-first.pt"), torch.load(tmp_path / "bitsandbytes-alone.pt"))


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

"""Regional torch.compile of the layers' bodies (``SAT_PATCHES_COMPILE_LAYERS=1``: the vision-expert MLP and the
attention's routed projections): eager's logits and LoRA gradients (CogVLM under SAT's checkpoint, CogAgent
without), one compiled function per body for every layer (inductor's C++ backend on the CPU)."""
import sat_patches  # noqa: F401  (first: makes ``import sat`` work here)

import pytest
import torch
from torch._dynamo.utils import counters

from sat_patches.core.settings import SettingError
from fast_paths import add_lora, build_cogvlm, cogvlm_batch, train_step


@pytest.mark.slow
@pytest.mark.parametrize("kind, checkpointed", [("cogvlm", True), ("cogagent", False)])
def test_compiled_bodies_give_eagers_values_with_one_graph_for_every_layer(monkeypatch, kind, checkpointed):
    depth = {"num_layers": 3} if kind == "cogvlm" else {}   # (CogAgent's tiny config lists its decoder layers)
    model, args = build_cogvlm(checkpointed, kind=kind, **depth)
    add_lora(model)
    batch = cogvlm_batch(args)
    eager_logits, eager_grads = train_step(model, batch)
    monkeypatch.setenv("SAT_PATCHES_COMPILE_LAYERS", "1")
    torch._dynamo.reset()
    counters.clear()
    logits, grads = train_step(model, batch)
    # whatever the depth, one graph per body (the MLP, the routed qkv and dense projections); checkpointed, each
    # twice: the forward without grad and its recomputation with it
    assert counters["stats"]["unique_graphs"] == (6 if checkpointed else 3), dict(counters["stats"])
    assert torch.allclose(logits, eager_logits, rtol=0, atol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, eager_grads[name], rtol=1e-4, atol=1e-6), name


def test_compiled_bodies_and_selective_checkpointing_are_refused_together(monkeypatch):
    model, args = build_cogvlm(True)
    monkeypatch.setenv("SAT_PATCHES_COMPILE_LAYERS", "1")
    monkeypatch.setenv("SAT_PATCHES_CHECKPOINT_SELECTIVE", "1")
    with pytest.raises(SettingError, match="set SAT_PATCHES_CHECKPOINT_SELECTIVE=0 or SAT_PATCHES_COMPILE_LAYERS=0"):
        train_step(model, cogvlm_batch(args))

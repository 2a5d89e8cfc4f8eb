"""A CogVLM/CogAgent LoRA training step through sat_patches' layer paths (expert routing, the rotary tables, the LoRA
layer's one product for its A factors, keys and values not re-expanded) against the plain path: stock SAT's
``LoraLinear`` and CogVLM's boolean-mask routing, the same weights. The same logits; the same LoRA gradients up to
the order of float sums (the layer input's gradient from the A factors is one product, not three summed)."""
import sat_patches  # noqa: F401  (first: makes ``import sat`` work here)

import pytest
import torch

from fast_paths import add_lora, boolean_mask_routing, build_cogvlm, cogvlm_batch, train_step
from patching import patches_removed

LORA_PATCHES = ("lora_linear", "lora_replace", "lora_merge", "lora_reinit")


@pytest.mark.parametrize("kind", ["cogvlm", "cogagent"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_lora_step_gives_the_plain_paths_logits_and_gradients(kind, checkpointing):
    model, args = build_cogvlm(checkpointing, kind=kind)
    add_lora(model)
    with patches_removed(*LORA_PATCHES):
        plain, _ = build_cogvlm(checkpointing, kind=kind)
        add_lora(plain)
    assert type(plain.transformer.layers[0].attention.query_key_value) is not type(
        model.transformer.layers[0].attention.query_key_value)
    plain.load_state_dict(model.state_dict())
    batch = cogvlm_batch(args)
    logits, grads = train_step(model, batch)
    with boolean_mask_routing():
        plain_logits, plain_grads = train_step(plain, batch)
    assert torch.allclose(logits, plain_logits, rtol=0, atol=1e-5)
    assert grads.keys() == plain_grads.keys() and any("matrix_A" in name for name in grads)
    for name, grad in grads.items():
        assert torch.allclose(grad, plain_grads[name], rtol=1e-4, atol=1e-6), name

"""Selective activation checkpointing (``SAT_PATCHES_CHECKPOINT_SELECTIVE``): the plain path's logits and LoRA
gradients, in CogVLM and CogAgent, every layer selective or half of them; no matrix product runs twice; the layers'
states as the planner counts them."""
import sat_patches  # noqa: F401  (first: makes ``import sat`` work here)

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sat_patches.core.settings import SettingError, read
from sat_patches.planning.timing import layer_states, selective_layers
from sat_patches.runtime.checkpointing import SETTING, expect_layer_chunks
from fast_paths import add_lora, build_cogvlm, checkpointing, cogvlm_batch, train_step

PRODUCTS = {"mm", "addmm", "bmm", "baddbmm"}
STATES = {"plain": (False, "0"), "full": (True, "0"), "selective": (True, "1"), "half selective": (True, "0.5")}


@pytest.fixture(scope="module", params=["cogvlm", "cogagent"])
def tiny_lora(request):
    model, args = build_cogvlm(False, kind=request.param)
    add_lora(model)
    return model, cogvlm_batch(args)


def step_in(state, model, batch, monkeypatch, step=train_step):
    on, share = STATES[state]
    monkeypatch.setenv(SETTING, share)
    checkpointing(model, on)
    return step(model, batch)


def test_selective_checkpointing_gives_the_plain_paths_logits_and_lora_gradients(tiny_lora, monkeypatch):
    model, batch = tiny_lora
    plain_logits, plain_grads = step_in("plain", model, batch, monkeypatch)
    assert len(plain_grads) == sum("matrix_" in n for n, _ in model.named_parameters())
    for state in ("full", "selective", "half selective"):
        logits, grads = step_in(state, model, batch, monkeypatch)
        assert torch.allclose(logits, plain_logits, rtol=0, atol=1e-6), state
        assert grads.keys() == plain_grads.keys(), state
        for name, grad in grads.items():
            assert torch.allclose(grad, plain_grads[name], rtol=1e-5, atol=1e-7), (state, name)


class ProductCount(TorchDispatchMode):
    """How many matrix products run while it is on (those a selective checkpoint serves from its store do not)."""

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in PRODUCTS:
            self.count[tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))] += 1
        return func(*args, **(kwargs or {}))


def test_a_selective_backward_multiplies_exactly_what_the_plain_backward_does(monkeypatch):
    """Every parameter trains (so every layer's input needs its gradient in both paths): the selective backward
    runs the plain backward's matrix products and no other; SAT's full checkpoint runs the forward's again."""
    model, args = build_cogvlm(False)
    batch = cogvlm_batch(args)

    def backward_products(model, batch):
        loss = model(**batch)[0].square().mean()
        with ProductCount() as products:
            loss.backward()
        return products.count

    plain, full, selective = (step_in(s, model, batch, monkeypatch, backward_products)
                              for s in ("plain", "full", "selective"))
    assert selective == plain
    assert sum(full.values()) > sum(plain.values())


def test_layer_states_as_the_planner_counts_them():
    assert layer_states(4, 1, 0.0) == ["full", "full", "full", "none"]
    assert layer_states(4, 1, 0.5) == ["full", "selective", "selective", "none"]   # 1.5 of 3 rounds up
    assert layer_states(4, 0, 1.0) == ["selective"] * 4
    assert layer_states(4, 1, 1.0, checkpointing=False) == ["none"] * 4
    assert [selective_layers(32, s) for s in (0, 0.25, 1)] == [0, 8, 32]
    assert expect_layer_chunks(None) is None   # SAT 0.4.12's forward is the one the patch reads


def test_a_share_that_is_not_one_says_what_to_set():
    with pytest.raises(SettingError, match=f"{SETTING}='all': set it to a share from 0 to 1"):
        read(SETTING, {SETTING: "all"})
    assert read(SETTING, {}) == 0.0

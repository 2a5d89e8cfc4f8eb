"""Expert routing without boolean-mask gathers: the same values and gradients as the masks, the mask read once
per step (also under activation checkpointing), and SAT's attention choosing its kernel without a sync per layer."""
import sat_patches  # noqa: F401  (first: makes ``import sat`` work here)

import pytest
import torch

from sat_patches.cogvlm import vision_expert
from sat_patches.cogvlm.routing import ExpertRouting, expert_routing
from sat_patches.kernels.attention import mask_kind
from sat_patches.runtime.tensor_memo import TensorMemo
from patching import patches_removed
from fast_paths import boolean_mask_routing, build_cogvlm as build, cogvlm_batch as batch_for, route_by_mask
from fast_paths import host_reads, train_step as step

COGVLM_LAYOUT = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0]] * 3)  # BOS, boi, patches, eoi, text


def experts(width=8, out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    language, vision = torch.nn.Linear(width, out), torch.nn.Linear(width, out)
    for layer in (language, vision):
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
    return language, vision


@pytest.mark.parametrize("mask, kind", [
    (COGVLM_LAYOUT, "mixed"),
    (torch.tensor([[1, 1, 0, 0, 0]] * 2), "mixed"),                     # at the start
    (torch.tensor([[0, 0, 0, 1, 1]] * 2), "mixed"),                     # at the end
    (torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0]]), "mixed"),        # rows differ
    (torch.tensor([[0, 1, 0, 1, 0], [0, 1, 0, 1, 0]]), "mixed"),        # not one run
    (torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]), "mixed"),        # a text-only row
    (torch.zeros(2, 5, dtype=torch.long), "language"),
    (torch.ones(2, 5, dtype=torch.long), "vision"),
])
def test_routing_gives_the_masks_values_and_gradients(mask, kind):
    routing = ExpertRouting.of_mask(mask)
    assert routing.kind == kind
    language, vision = experts()
    x = torch.randn(*mask.shape, 8, requires_grad=True)
    fast = routing.apply(x, language, vision)
    reference = route_by_mask(x, mask, language, vision) if mask.any() else language(x)
    assert torch.equal(fast, reference)
    grads = [torch.autograd.grad(out.square().sum(), [x, language.weight, vision.weight], allow_unused=True)
             for out in (fast, reference)]
    for a, b in zip(*grads):  # (an expert given no token: no gradient, or zeros from an empty gather)
        a, b = (torch.zeros(()) if g is None else g for g in (a, b))
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_each_expert_is_given_its_tokens_as_one_contiguous_matrix():
    """As upstream's boolean gathers give them: one ``[tokens, features]`` product per expert, no batched one."""
    seen = {}

    def expert(name, layer):
        def run(x):
            seen[name] = (x.dim(), x.is_contiguous(), x.shape[0])
            return layer(x)
        return run

    language, vision = experts()
    routing = ExpertRouting.of_mask(COGVLM_LAYOUT)
    routing.apply(torch.randn(*COGVLM_LAYOUT.shape, 8), expert("language", language), expert("vision", vision))
    assert seen == {"language": (2, True, 15), "vision": (2, True, 12)}


def test_a_mask_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        ExpertRouting.of_mask(torch.ones(2, 3, 4))


def test_the_memo_serves_detached_copies_and_sees_in_place_writes():
    seen = []
    memo = TensorMemo(lambda t: seen.append(1) or int(t.sum()))
    mask = torch.tensor([[0, 1, 1, 0]])
    assert memo(mask) == 2 and memo(mask.detach()) == 2 and len(seen) == 1  # recomputation's copies share it
    mask[0, 0] = 1
    assert memo(mask) == 3 and len(seen) == 2                                 # an in-place write is seen
    assert memo(mask[:, 1:]) == 2 and len(seen) == 3                          # another view of the storage
    del mask
    assert len(memo._entries) == 0                                           # nothing kept alive


@pytest.mark.parametrize("kind", ["cogvlm", "cogagent"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_model_routed_equals_mask_routing(checkpointing, kind):
    model, args = build(checkpointing, kind=kind)
    batch = batch_for(args)
    assert expert_routing(batch["vision_expert_mask"]).kind == "mixed"
    fast_logits, fast_grads = step(model, batch)
    with boolean_mask_routing():
        ref_logits, ref_grads = step(model, batch)
    assert torch.allclose(fast_logits, ref_logits, rtol=0, atol=1e-5)
    assert fast_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert torch.allclose(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6), name


def test_a_ragged_batch_routes_with_the_same_values():
    model, args = build(False)
    batch = batch_for(args)
    batch["vision_expert_mask"][1] = 0           # a text-only sample beside one with an image
    assert expert_routing(batch["vision_expert_mask"]).kind == "mixed"
    fast_logits, fast_grads = step(model, batch)
    with boolean_mask_routing():
        ref_logits, ref_grads = step(model, batch)
    assert torch.allclose(fast_logits, ref_logits, rtol=0, atol=1e-5)
    for name in ref_grads:
        assert torch.allclose(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6), name


def test_a_checkpointed_step_reads_its_masks_once_not_per_layer():
    """The mask's routing, the rotary cache length and the attention mask's kind: one read each per step, also in
    the recomputed layers; CogVLM's own routing and SAT's own attention read them in every layer, twice."""
    model, args = build(True)
    batch = batch_for(args)
    before = (expert_routing.computed, vision_expert.max_position.computed, mask_kind.computed)
    step(model, batch)
    after = (expert_routing.computed, vision_expert.max_position.computed, mask_kind.computed)
    assert [b - a for a, b in zip(before, after)] == [1, 1, 2]  # two attention masks: the language model's, EVA's
    fast = host_reads(lambda: step(model, batch_for(args, seed=1)))  # (a new batch: its reads counted alone)
    with boolean_mask_routing(), patches_removed("attention_mask_read_once"):
        slow = host_reads(lambda: step(model, batch_for(args, seed=2)))
    layers = args.num_layers
    assert slow - fast >= 2 * layers * 3, (fast, slow)  # per layer, forward and recomputation: at least 3 each


@pytest.mark.parametrize("mask", [torch.ones(6, 6).tril(), torch.ones(6, 6), torch.ones(1, 1),
                                  torch.tensor([[1., 1, 0, 0, 0, 0]]).repeat(6, 1)],
                         ids=["causal", "full", "one", "padding"])
def test_attention_gives_sats_values_with_the_mask_read_once(mask):
    from sat.transformer_defaults import attention_fn_default
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mask = mask[None, None]
    with patches_removed("attention_mask_read_once"):
        from sat.transformer_defaults import attention_fn_default as sats
        expected = sats(q, k, v, mask)
    assert attention_fn_default is not sats
    before = mask_kind.computed
    for _ in range(3):
        assert torch.allclose(attention_fn_default(q, k, v, mask), expected, atol=1e-6)
    assert mask_kind.computed - before == 1


def test_attention_expands_grouped_key_value_heads_as_sat_does():
    from sat.transformer_defaults import attention_fn_default
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(6, 6).tril()[None, None]
    with patches_removed("attention_mask_read_once"):
        from sat.transformer_defaults import attention_fn_default as sats
        expected = sats(q, k, v, mask)
    assert torch.allclose(attention_fn_default(q, k, v, mask), expected, atol=1e-6)


def test_keys_and_values_with_one_head_per_query_head_are_not_re_expanded():
    from torch.utils._python_dispatch import TorchDispatchMode
    from sat.transformer_defaults import attention_fn_default
    names = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(2, 6, 4, 8).transpose(1, 2) for _ in range(3))  # as SAT's layers hand them over
    mask = torch.ones(6, 6).tril()[None, None]
    attention_fn_default(q, k, v, mask)
    with Names():
        attention_fn_default(q, k, v, mask)
    assert "expand" not in names and names.count("clone") == 2  # made contiguous, as SAT's expand by one did

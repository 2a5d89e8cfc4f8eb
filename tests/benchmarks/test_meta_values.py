"""MetaValues: meta tensors that carry the values of small inputs, so a real model's value checks and
boolean routing run at full size without memory."""
import pytest
import torch

from meta_values import SHADOW_LIMIT, MetaValues


def test_value_checks_and_boolean_indexing_run_on_meta_with_the_inputs_values():
    x = torch.empty(1, 10, 4, device="meta", requires_grad=True)
    with MetaValues() as values:
        mask = values.meta(torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0, 0, 0]]))
        causal = values.meta(torch.ones(1, 1, 10, 10).tril()).type_as(x)     # moved and cast: values kept
        assert bool((causal == torch.ones_like(causal).tril()).all())
        assert not bool((causal > 0).all())
        assert int(mask.sum()) == 3
        routed = mask.bool()
        inside, outside = x[routed], x[~routed]
        out = inside.new_empty(1, 10, 4)
        out[routed] = inside * 2
        out[~routed] = outside
        out.sum().backward()
    assert (inside.shape, outside.shape, out.device.type) == ((3, 4), (7, 4), "meta")
    assert x.grad.shape == x.shape and x.grad.device.type == "meta"


def test_outside_the_mode_and_for_large_or_weight_derived_results_meta_stays_meta():
    with MetaValues() as values:
        ids = values.meta(torch.zeros(SHADOW_LIMIT // 8 + 1, dtype=torch.long))
        with pytest.raises(RuntimeError, match="meta"):
            int((ids + 1).sum())                              # ids + 1 is too large to keep values for
        weight = torch.empty(4, device="meta")
        with pytest.raises(RuntimeError, match="meta"):
            bool((weight > 0).all())                          # no values behind a weight
    with pytest.raises(RuntimeError, match="meta"):
        int(torch.empty(3, device="meta").sum())

"""MetaValues: meta tensors that carry the values of small inputs, so a real model's value checks and
boolean routing run at full size without memory."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class KernelCalls(TorchDispatchMode):
    """Entered before MetaValues: sees the operations MetaValues runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_an_operation_making_new_tensors_runs_its_meta_kernel_once_per_signature_and_views_every_time():
    aten = torch.ops.aten
    with KernelCalls() as kernels, MetaValues():
        a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta").t()
        first, again, other = a * 2, a * 2, b * 2                # b: another stride
        views = [a.view(8, 4), a.view(8, 4)]
        laid_out = torch.empty_strided((3, 5), (1, 3), device="meta") + 1
    assert kernels.calls.count(aten.mul.Tensor) == 2 and kernels.calls.count(aten.view.default) == 2
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata   # a tensor of its own
    assert other.stride() == b.stride() == (1, 8) and laid_out.stride() == (1, 3)
    assert all(v.untyped_storage()._cdata == a.untyped_storage()._cdata for v in views)
    with KernelCalls() as kernels, MetaValues(remember_outputs=False):
        a = torch.empty(4, 8, device="meta")
        a * 2, a * 2
    assert kernels.calls.count(aten.mul.Tensor) == 2


@pytest.mark.slow  # a layer measured twice on meta (about 4 s)
def test_remembered_outputs_give_the_peaks_of_every_kernel_run():
    """CogAgent's language layer, checkpointed at MP=2 (each of its models has a layer of every kind besides)."""
    from layer_bytes import layer_bytes
    from sat_patches.cogvlm.config import tiny_config
    plain, remembered = (layer_bytes(tiny_config("cogagent"), "language", 2, checkpoint=True, remember_outputs=r)
                         for r in (False, True))
    assert plain == remembered > 0, (plain, remembered)

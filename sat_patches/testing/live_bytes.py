"""Peak bytes of the tensors alive during a region, counted per storage: works on meta tensors, which have
no memory, so full-size layers are measured in seconds on a CPU machine.

    with LiveBytes() as counter:
        loss = layer(x).sum(); loss.backward()
    counter.peak      # the most bytes of storages created inside the region alive at once

Every storage an operation returns that none of its inputs holds is counted once, from its creation
until it is freed (a weak reference to the storage: autograd's saved tensors keep it alive, as they keep
the memory of a real run). Storages that existed before the region (parameters, inputs) are not counted.
"""
from __future__ import annotations

import contextlib
from typing import Dict
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.multiprocessing.reductions import StorageWeakRef


def _storages(values):
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor):
            yield StorageWeakRef(value.untyped_storage()), value.untyped_storage().nbytes()


class LiveBytes(TorchDispatchMode):
    """``current``: bytes of counted storages alive now; ``peak``: the most at any point of the region."""

    def __init__(self):
        super().__init__()
        self.live: Dict[StorageWeakRef, int] = {}
        self.current = self.peak = 0

    def _collect(self) -> None:
        for ref in [r for r in self.live if r.expired()]:
            self.current -= self.live.pop(ref)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {ref for ref, _ in _storages((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        self._collect()
        for ref, size in _storages(out):
            if ref not in inputs and ref not in self.live:
                self.live[ref] = size
                self.current += size
        self.peak = max(self.peak, self.current)
        return out

    def __exit__(self, *exc):
        self._collect()
        return super().__exit__(*exc)


@contextlib.contextmanager
def collectives_stood_in(mp):
    """SAT's model-parallel gather and copy as their output shapes (no process group on meta)."""
    import sat.mpu.layers as layers
    with mock.patch.object(layers, "gather_from_model_parallel_region", lambda x: torch.cat([x] * mp, dim=-1)), \
            mock.patch.object(layers, "copy_to_model_parallel_region", lambda x: x):
        yield


def head_and_loss_peak(mp, tokens, hidden, vocab):
    """Forward and backward of the LM head (SAT's ColumnParallelLinear with gather_output, as
    ``sat_patches.cogvlm.llama.LMMixin``) and the loss of ``sat_patches.finetune.lm_loss``, in bf16."""
    from sat.mpu import ColumnParallelLinear
    from .full_size import model_parallel_as
    with model_parallel_as(mp), collectives_stood_in(mp):
        head = ColumnParallelLinear(hidden, vocab, gather_output=True, bias=False, params_dtype=torch.bfloat16,
                                    skip_init=True, device="meta").requires_grad_(False)
        x = torch.empty(1, tokens, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
        labels = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        with LiveBytes() as counter:
            logits = head(x).float()
            shift_labels = labels[..., 1:].contiguous()
            shift_logits = logits[..., -1 - shift_labels.size(-1):-1, :].contiguous()
            torch.nn.functional.cross_entropy(shift_logits.view(-1, vocab), shift_labels.view(-1),
                                              ignore_index=-100).backward()
    return counter.peak

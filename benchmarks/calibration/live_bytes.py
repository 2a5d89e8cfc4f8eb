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

from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef

_expired = torch.UntypedStorage._expired  # (a storage's address) -> whether it was freed


def tensors_in(value, found=None) -> List[torch.Tensor]:
    """The tensors of an operation's arguments or results (tensors in nested tuples, lists and dicts), in order:
    what ``torch.utils._pytree.tree_flatten`` finds among them, without its per-node bookkeeping (the counters run
    it several times on every operation of a full-size step)."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            tensors_in(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, found)
    return found


class LiveBytes(TorchDispatchMode):
    """``current``: bytes of counted storages alive now; ``peak``: the most at any point of the region."""

    def __init__(self):
        super().__init__()
        # a counted storage's address -> (a weak reference keeping the address its own, its bytes)
        self.live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def _collect(self) -> None:
        for address in [a for a in self.live if _expired(a)]:
            self.current -= self.live.pop(address)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        new = {}
        for t in tensors_in(out):
            storage = t.untyped_storage()
            address = storage._cdata
            if address not in inputs and address not in self.live:
                new[address] = storage
        if not new:  # nothing allocated: the peak cannot rise (what was freed is counted at the next allocation)
            return out
        self._collect()
        for address, storage in new.items():
            size = storage.nbytes()
            self.live[address] = (StorageWeakRef(storage), size)
            self.current += size
        self.peak = max(self.peak, self.current)
        return out

    def __exit__(self, *exc):
        self._collect()
        return super().__exit__(*exc)


def head_and_loss_peak(mp, tokens, hidden, vocab):
    """Forward and backward of the LM head (SAT's ColumnParallelLinear with gather_output, as
    ``sat_patches.cogvlm.llama.LMMixin``) and the loss of ``sat_patches.cogvlm.trainer.lm_loss``, in bf16."""
    from sat.mpu import ColumnParallelLinear
    from sat_patches.cogvlm.on_meta import model_parallel_as
    from collective_shapes import collectives_as_shapes
    with model_parallel_as(mp), collectives_as_shapes(mp):
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


def one_layer_saved_bytes(tiny, shapes):
    """(a rank) For each ``(hidden, ffn, heads, tokens, dtype)``: the bytes one more language layer of the
    CogVLM model keeps for backward (LoRA on attention and EVA, the base frozen, as a LoRA run trains):
    the peak of a 3-layer model's forward and backward less a 2-layer model's."""
    import torch
    from sat.arguments import _simple_init
    from sat.model.base_model import get_model
    from sat_patches.cogvlm import trainer as finetune
    from sat_patches.cogvlm import create_dataset_function, data_collator, llama2_tokenizer, model_class_for, tiny_args
    _simple_init(model_parallel_size=1, seed=1)
    tokenizer = llama2_tokenizer(tiny.tokenizer_dir)

    def peak(layers, hidden, ffn, heads, tokens, dtype):
        args = tiny_args("cogvlm", num_layers=layers, hidden_size=hidden, inner_hidden_size=ffn,
                         num_attention_heads=heads, lora_rank=4, layer_range=None, use_qlora=False)
        args.eva_args = dict(args.eva_args, num_layers=1)
        torch.manual_seed(0)
        model = get_model(args, model_class_for("cogvlm"))
        finetune.add_lora(model, args)
        model = model.to(dtype)
        for name, p in model.named_parameters():
            p.requires_grad_("matrix_" in name)
        args.max_length = tokens
        image, text, cross = finetune.processors(args, tokenizer)
        batch = data_collator([create_dataset_function(image, text, cross, tiny.valid_jsonl, args)[0]])
        batch = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
        with LiveBytes() as counter:
            finetune.lm_loss(model, {**finetune.model_inputs(batch), "labels": batch["labels"]}).backward()
        return counter.peak

    return [peak(3, *shape) - peak(2, *shape) for shape in shapes]

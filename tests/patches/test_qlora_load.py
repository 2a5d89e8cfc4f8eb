"""QLoRA runs load the base as NF4, linear by linear: the float model never exists whole on the device.

Upstream CogVLM's QLoRA sequence: ``args.device = 'cpu'``, ``from_pretrained``, then
``add_mixin("lora", LoraMixin(..., qlora=True), reinit=True)``. Here the transformer's linears are NF4
as soon as each is loaded, the mixin wraps them as they are, and the model trains.
"""
import os

import pytest
import torch

import lora_state
from sat_patches.lora import layer as lora_layer
from sat_patches.lora import qlora as qlora_lib
import expert_llama as el
from mappings import in_file

CFG = dict(num_layers=6, hidden_size=128, num_attention_heads=4, inner_hidden_size=256, num_vision_layers=0)


def held_bytes(model) -> int:
    """Bytes of every tensor storage the model holds off meta (NF4 data and its absmax included)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [w.quant_state.absmax for w in model.parameters() if getattr(w, "quant_state", None) is not None]
    for t in tensors:
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def load(path, cfg, qlora, monkeypatch):
    """Upstream's sequence up to from_pretrained; the peak of ``held_bytes`` while it loads."""
    peaks = [0]
    streaming = qlora_lib.nf4_as_loaded

    def sampled(model, args):
        inner = streaming(model, args)

        def after(module, prefix):
            peaks[0] = max(peaks[0], held_bytes(model))
            if inner:
                inner(module, prefix)
        if getattr(inner, "converts", None):
            after.converts = inner.converts
        return after
    monkeypatch.setattr(qlora_lib, "nf4_as_loaded", sampled)
    args = el.build_args(cfg)
    args.use_qlora, args.device = qlora, "cpu"
    model, _ = el.model_class().from_pretrained(path, args)
    return model, max(peaks[0], held_bytes(model))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qlora") / "ckpt")
    cfg = el.config(**CFG)
    model = el.model_class()(el.build_args(cfg))
    el.fill_(model)
    el.write_checkpoint(model, cfg, path)
    return path, cfg, held_bytes(model)


def test_linears_are_nf4_as_loaded_and_the_peak_is_nf4_plus_one_layer(checkpoint, monkeypatch):
    path, cfg, float_bytes = checkpoint
    model, peak = load(path, cfg, True, monkeypatch)
    linears = [m for root in qlora_lib.qlora_base(model) for m in root.modules() if isinstance(m, qlora_lib.FLOAT_LINEARS)]
    assert linears and all(lora_layer._is_nf4(m) for m in linears)  # before any LoRA was added
    layer_float = float_bytes - held_bytes(el.model_class()(el.build_args(dict(cfg, num_layers=5))))
    assert peak <= held_bytes(model) + 1.05 * layer_float, (peak, held_bytes(model), layer_float)
    assert peak / float_bytes <= 0.5, peak / float_bytes
    _, stock_peak = load(path, cfg, False, monkeypatch)  # the same load without QLoRA holds the float model
    assert stock_peak >= 0.95 * float_bytes


@pytest.mark.slow  # two loads compared page by page (~3 s)
def test_a_qlora_load_copies_what_it_converts_and_lends_what_it_keeps(checkpoint):
    """A load that converts linears as they arrive copies their float weights instead of lending the mapped
    file's (lent, their pages would stay mapped after conversion): no NF4 weight is the file's. What stays
    as saved (embeddings, LM head, norms) is lent from the file, as in a load without QLoRA."""
    path, cfg, _ = checkpoint
    args = el.build_args(cfg)
    args.use_qlora, args.device = True, "cpu"
    model, _ = el.model_class().from_pretrained(path, args)
    shard = os.path.join(path, "1", "mp_rank_00_model_states.pt")
    nf4 = {id(m.weight) for m in model.modules() if lora_layer._is_nf4(m)}
    tensors = list(model.parameters()) + list(model.buffers())
    assert nf4 and [t.shape for t in tensors if id(t) in nf4 and in_file(t, shard)] == []
    kept = [p for p in model.parameters() if id(p) not in nf4]  # (buffers such as rotary tables are not saved)
    assert kept and [t.shape for t in kept if not in_file(t, shard)] == []


def test_the_peak_above_the_nf4_model_is_one_linear_not_one_layer(checkpoint, monkeypatch):
    """Each linear becomes NF4 as soon as it is loaded: what the model holds beyond its final NF4 self is at
    most the float weights of one linear (the largest), never a whole layer's."""
    path, cfg, _ = checkpoint
    model, peak = load(path, cfg, True, monkeypatch)
    floats = el.model_class()(el.build_args(cfg))
    linears = [m for root in qlora_lib.qlora_base(floats) for m in root.modules() if isinstance(m, qlora_lib.FLOAT_LINEARS)]
    largest = max(m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0) for m in linears)
    layer = sum(p.nbytes for p in floats.transformer.layers[0].parameters())
    assert layer > 2 * largest  # a layer's float weights would not fit in the bound below
    assert peak <= held_bytes(model) + largest, (peak, held_bytes(model), largest, layer)


def test_lora_wraps_the_nf4_bases_as_they_are_and_the_model_trains(checkpoint, monkeypatch):
    from sat.model.finetune.lora2 import LoraMixin
    path, cfg, _ = checkpoint
    model, _ = load(path, cfg, True, monkeypatch)
    bases = {id(m) for m in model.transformer.modules() if lora_layer._is_nf4(m)}
    model.add_mixin("lora", LoraMixin(cfg["num_layers"], 4, qlora=True), reinit=True)
    wrapped = [m for m in model.transformer.modules() if lora_state.is_lora_layer(m)]
    assert wrapped and all(id(m.original) in bases for m in wrapped)  # no second quantisation
    trainable = [p for n, p in model.named_parameters() if "matrix_" in n]
    for p in model.parameters():
        p.requires_grad_(any(p is t for t in trainable))
    optimizer = torch.optim.Adam(trainable, lr=0.02)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=g)
    targets = torch.full((2, 8), 5)  # one token to learn: the adapters alone can move the logits to it
    losses = []
    for _ in range(12):
        logits = model(input_ids=ids, position_ids=torch.arange(8)[None].expand_as(ids),
                       attention_mask=torch.ones(1, 1, 8, 8).tril())[0]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1, losses


def test_mp2_with_nf4_is_refused_before_loading(monkeypatch):
    import argparse
    monkeypatch.setattr(qlora_lib, "get_model_parallel_world_size", lambda: 2)
    model = torch.nn.Module()
    model.transformer = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="use MP_SIZE=1"):
        qlora_lib.nf4_as_loaded(model, argparse.Namespace(use_qlora=True))


def test_cpu_quantisation_gives_bitsandbytes_bits_a_bounded_chunk_at_a_time(monkeypatch):
    """bitsandbytes' CPU quantiser holds ~11 bytes per input element: it only ever sees a chunk, and the
    NF4 weight (codes, absmax, double-quantised statistics) is the one it makes of the whole tensor."""
    import bitsandbytes.functional as bnbf
    weight = torch.randn(300, 200, dtype=torch.bfloat16)
    expected, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    seen, op = [], torch.ops.bitsandbytes.quantize_4bit

    class Counting:
        @staticmethod
        def default(A, *args):
            seen.append(A.numel())
            return op.default(A, *args)
    monkeypatch.setattr(torch.ops.bitsandbytes, "quantize_4bit", Counting)
    monkeypatch.setattr(qlora_lib, "CPU_QUANTIZE_CHUNK", 4096)
    layer = qlora_lib.nf4_linear(weight, None)
    assert len(seen) == 15 and max(seen) == 4096, seen
    got = layer.weight
    assert torch.equal(got.data, expected)
    for name in ("absmax", "offset", "shape", "dtype", "blocksize", "quant_type"):
        assert torch.equal(*(torch.as_tensor(getattr(s, name)) for s in (got.quant_state, state))) \
            if isinstance(getattr(state, name), torch.Tensor) else getattr(got.quant_state, name) == getattr(state, name)
    assert torch.equal(got.quant_state.state2.absmax, state.state2.absmax)
    assert torch.equal(bnbf.dequantize_4bit(got.data, got.quant_state), bnbf.dequantize_4bit(expected, state))

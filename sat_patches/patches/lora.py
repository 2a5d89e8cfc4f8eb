"""LoRA for SwissArmyTransformer 0.4.12 (``sat/model/finetune/lora2.py``): by reference, on the right device,
correct under model parallelism, and QLoRA that runs.

What stock ``lora2`` does, and what replaces it here:

* ``LoraLinear.__init__`` builds a second full-size base layer (CPU by default; ``nn.Linear`` also
  runs its kaiming init), copies a clone of the original weight into it, and makes ``matrix_A/B``
  with ``torch.empty`` on the CPU. Here the base layer object is kept (same Parameter, zero bytes
  copied) and A/B are created on the base weight's device and dtype (the policy's compute device
  when the base is still on meta). A is kaiming-uniform (a=sqrt(5)), B zeros, as upstream and peft.
* Under model parallelism stock LoRA on a ``RowParallelLinear`` (``attention.dense``) multiplies the
  rank-local slice of x by A and never sums the slices: ranks disagree once B != 0. Here the
  layout follows the base layer: column-parallel: A replicated, B split with the base rows;
  row-parallel: A split with the base columns and ``x @ A^T`` all-reduced, B replicated; plain
  ``nn.Linear``: both replicated, no collective. ``model_parallel``/``tensor_model_parallel`` are
  set on exactly the split factors (SAT's parameter sync, DeepSpeed's gradient norm).
* ``merge_linear_lora`` returned a plain ``nn.Linear(...).cuda()``. Here ``B @ A`` is added to the
  base weight in place, in row chunks of at most :data:`CHUNK_BYTES`, and the base layer itself is
  returned (its own type, device, parallel semantics, bias or none).
* QLoRA (``qlora=True``) raised ``NameError: cannot access free variable 'dtype'``, and merging
  assumed a bias and dequantised NF4 with ``dequantize_fp4``. Here the base is quantised to NF4 on
  its own device, the rest of the transformer's linears are quantised at once, and merge
  dequantises with ``dequantize_4bit``, adds the product, and quantises again.

State-dict keys are stock SAT's (``...original.weight``, ``...matrix_A.0``, ``...matrix_B.0``): stock
LoRA checkpoints load, what is saved here loads into stock SAT. :func:`split_lora_state_dict` and
:func:`merge_lora_state_dicts` convert LoRA layers of a state dict between model-parallel sizes.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from sat.helpers import print_rank0
from sat.mpu import mappings
from sat.mpu.initialize import get_model_parallel_world_size
from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear

from . import devices
from ..checkpoints.sharding import COLUMN, PLAIN, ROW, lora_factor_split, parallel_kind
from ..core.registry import Patch, expect_names, expect_params

CHUNK_BYTES = int(float(os.environ.get("SAT_PATCHES_LORA_CHUNK_MB", "64")) * 2**20)
"""Largest temporary (bytes) of a LoRA merge; ``SAT_PATCHES_LORA_CHUNK_MB`` sets it (default 64)."""

def full_shape(layer: nn.Module):
    """(out_features, in_features) of ``layer`` over all model-parallel ranks."""
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        return layer.output_size, layer.input_size
    if _is_nf4(layer):  # its weight is packed
        return layer.out_features, layer.in_features
    return tuple(layer.weight.shape)


def segment_sizes(rows: int, partition) -> List[int]:
    """Row counts of the stacked outputs (e.g. Q, K, V) of a base layer with ``rows`` rows.

    ``partition`` is SAT's: a count of equal parts (the attention ``stride``), or a list of ratios
    (multi-query attention: heads, kv heads, kv heads).
    """
    ratios = [1] * partition if isinstance(partition, int) else list(partition)
    if rows % sum(ratios):
        raise ValueError(f"{rows} rows cannot be split in the ratios {ratios}")
    return [rows // sum(ratios) * k for k in ratios]


def _mark_split(param: nn.Parameter, split: bool) -> None:
    # SAT syncs parameters by this flag; DeepSpeed counts gradient norms of unsplit ones once.
    param.model_parallel = split
    param.tensor_model_parallel = split


def _beside(weight: torch.Tensor, *shape: int) -> torch.Tensor:
    """An uninitialised tensor on ``weight``'s device and dtype; on the policy's compute device
    when ``weight`` is still on meta (LoRA factors are in no base checkpoint to materialise them)."""
    device = devices.compute_device()
    if weight.device.type == "meta" and device.type != "meta":
        return torch.empty(shape, dtype=weight.dtype, device=device)
    return weight.new_empty(shape)


def _is_nf4(layer: nn.Module) -> bool:
    return getattr(getattr(layer, "weight", None), "quant_type", None) in ("nf4", "fp4")


# --------------------------------------------------------------------------------------
# The LoRA layer
# --------------------------------------------------------------------------------------

class LoraLinear(nn.Module):
    """``original(x) + scaling * B(A(dropout(x)))``, with ``original`` kept by reference.

    Same constructor as SAT's ``LoraLinear``; ``original_cls``, ``in_dim`` and ``out_dim`` are
    accepted for compatibility, the base layer's own type and shape are what count. ``partition``
    is the number (or the ratios) of stacked outputs of the base layer (3 for a fused QKV): each
    gets its own A and B.
    """

    def __init__(self, original_cls, partition, in_dim, out_dim, r, lora_alpha=1., lora_dropout=0.,
                 qlora=False, original_obj=None):
        super().__init__()
        if original_obj is None:
            raise TypeError("LoraLinear needs the layer it wraps: original_obj=")
        nf4_base = _is_nf4(original_obj)  # quantised as it was loaded (a QLoRA run): kept as it is
        weight = original_obj.weight
        if nf4_base:  # the LoRA factors' device and dtype: the base's compute dtype, not its packed bytes
            weight = torch.empty(0, dtype=original_obj.compute_dtype, device=weight.device)
        self.kind = parallel_kind(original_obj)
        self.input_is_parallel = getattr(original_obj, "input_is_parallel", True)
        self.gather_output = getattr(original_obj, "gather_output", False)
        self.partition = partition
        self.r, self.lora_alpha, self.scaling = r, lora_alpha, lora_alpha / r
        self.fan_in = full_shape(original_obj)[1]
        self.lora_dropout = nn.Dropout(p=lora_dropout) if lora_dropout else nn.Identity()
        if qlora and self.kind != PLAIN and get_model_parallel_world_size() > 1:
            raise NotImplementedError("QLoRA with model_parallel_size > 1 is not supported: an NF4 "
                                      "base layer has no model-parallel forward")
        self.original = quantize_nf4(original_obj) if qlora and not nf4_base else original_obj

        out_features, in_features = full_shape(original_obj) if nf4_base else weight.shape  # this rank's slice
        rows = segment_sizes(out_features, partition)
        self.matrix_A = nn.ParameterList(nn.Parameter(_beside(weight, r, in_features)) for _ in rows)
        self.matrix_B = nn.ParameterList(nn.Parameter(_beside(weight, n, r)) for n in rows)
        for factor in ("matrix_A", "matrix_B"):
            split = lora_factor_split(self.kind, factor) is not None
            for p in getattr(self, factor):
                _mark_split(p, split)
        self.reset_lora_parameters()
        self.register_load_state_dict_post_hook(_plain_checkpoint_has_no_lora_keys)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """A: kaiming_uniform_(a=sqrt(5)) of the full (unsplit) A, i.e. U(+-1/sqrt(fan_in)); B: 0."""
        bound = 1 / math.sqrt(self.fan_in)
        for a in self.matrix_A:
            a.uniform_(-bound, bound)
        for b in self.matrix_B:
            b.zero_()

    def _lora(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        xa = x @ a.t()
        if self.kind == ROW:  # x and A are this rank's slices: their products add up to x @ A^T
            xa = mappings.reduce_from_model_parallel_region(xa)
        elif self.kind == COLUMN:  # backward: dL/d(xA^T) sums over the output slices of all ranks
            xa = mappings.copy_to_model_parallel_region(xa)
        return xa @ b.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.original(x)
        x = self.lora_dropout(x)
        if self.kind == ROW and not self.input_is_parallel:
            x = mappings.scatter_to_model_parallel_region(x)
        lora = torch.cat([self._lora(x, a, b) for a, b in zip(self.matrix_A, self.matrix_B)], -1)
        if self.kind == COLUMN and self.gather_output:
            lora = mappings.gather_from_model_parallel_region(lora)
        return out + lora * self.scaling

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if prefix + "weight" in state_dict:
            # A checkpoint of the plain layer (taken before LoRA was added): it is the base layer's.
            self.original._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                                missing_keys, unexpected_keys, error_msgs)
            self._loaded_plain_at = prefix
        else:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, partition={self.partition}, r={self.r}, scaling={self.scaling}"


def _plain_checkpoint_has_no_lora_keys(module: LoraLinear, incompatible) -> None:
    """After loading a plain-layer checkpoint, A/B keep their init and are not "missing" (as stock)."""
    prefix = module.__dict__.pop("_loaded_plain_at", None)
    if prefix is not None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(prefix)]


def replace_linear_with_lora(lin, partition, r, *args, **kw_args):
    """Wrap ``lin`` in a LoRA layer (``lin`` is kept, nothing is moved or copied).

    ``in_size``/``out_size`` (SAT's reinit passes ``hidden_size``, wrong for ``attention.dense`` when
    ``inner_hidden_size`` differs) are accepted and ignored: the layer's own full shape is used.
    """
    from sat.model.finetune import lora2
    kw_args.pop("in_size", None)
    kw_args.pop("out_size", None)
    out_dim, in_dim = full_shape(lin)
    return lora2.LoraLinear(type(lin), partition, in_dim, out_dim, r, *args, original_obj=lin, **kw_args)


# --------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------

@torch.no_grad()
def add_lora_product(weight: torch.Tensor, lin: nn.Module, chunk_bytes: Optional[int] = None) -> None:
    """``weight[segment i] += scaling * B_i @ A_i`` in place, ``chunk_bytes`` of fp32 rows at a time.

    As stock SAT's merge, the sum is formed in fp32 and then stored in the weight's dtype; the one
    temporary of weight size is a chunk of those fp32 rows.
    """
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows_per_chunk = max(1, chunk_bytes // (weight.shape[1] * 4))
    offset = 0
    for a, b in zip(lin.matrix_A, lin.matrix_B):
        a = a.detach().float()
        for start in range(0, b.shape[0], rows_per_chunk):
            stop = min(start + rows_per_chunk, b.shape[0])
            rows = weight[offset + start:offset + stop]
            summed = rows.float() if rows.dtype != torch.float32 else rows
            summed.addmm_(b[start:stop].detach().float(), a, alpha=lin.scaling)
            if summed is not rows:
                rows.copy_(summed)
            del summed  # before the next chunk's is allocated
        offset += b.shape[0]
    if offset != weight.shape[0]:
        raise ValueError(f"LoRA B has {offset} rows, the base weight {weight.shape[0]}")


def merge_linear_lora(lin, chunk_bytes: Optional[int] = None):
    """Fold the LoRA product into the base layer and return the base layer.

    The base weight is updated in place (no temporary above ``chunk_bytes``); the returned layer is
    the original object: ColumnParallelLinear/RowParallelLinear/nn.Linear on its own device, with its
    bias or none. An NF4 base is dequantised, updated and quantised again (whole-tensor steps).
    """
    base = lin.original
    if not _is_nf4(base):
        add_lora_product(base.weight, lin, chunk_bytes)
        return base
    weight = dequantize_nf4(base)
    add_lora_product(weight, lin, chunk_bytes)
    return nf4_linear(weight, base.bias)


# --------------------------------------------------------------------------------------
# QLoRA (bitsandbytes NF4)
# --------------------------------------------------------------------------------------

# Elements quantised at a time on CPU: bitsandbytes' CPU ``quantize_4bit`` (pure torch) holds about 11 bytes of
# temporaries per element of its input, over 100 MB for one LLaMA MLP weight.
CPU_QUANTIZE_CHUNK = 2 ** 20


def nf4_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Module:
    """A bitsandbytes ``LinearNF4`` holding ``weight`` quantised on its own device; ``bias`` by reference."""
    from bitsandbytes.nn import LinearNF4, Params4bit
    if weight.device.type == "meta":
        raise ValueError("QLoRA quantises the base weights: load them before adding LoRA (they are on meta)")
    out_features, in_features = weight.shape
    layer = LinearNF4(in_features, out_features, bias=False, compute_dtype=weight.dtype, device="meta")
    template = layer.weight
    if weight.device.type == "cpu":
        packed, state = quantize_nf4_in_chunks(weight.detach(), template.blocksize, template.quant_storage)
        layer.weight = Params4bit(packed, requires_grad=False, quant_state=state, blocksize=template.blocksize,
                                  compress_statistics=True, quant_type="nf4", quant_storage=template.quant_storage,
                                  module=layer, bnb_quantized=True)
        layer.quant_state = state
    else:
        layer.weight = Params4bit(weight.detach(), requires_grad=False, quant_type="nf4",
                                  compress_statistics=template.compress_statistics,
                                  quant_storage=template.quant_storage, module=layer).to(weight.device)
    layer.bias = bias
    return layer


def quantize_nf4_in_chunks(weight: torch.Tensor, blocksize: int, storage: torch.dtype,
                           chunk: Optional[int] = None):
    """``bitsandbytes.functional.quantize_4bit(weight, blocksize, compress_statistics=True, quant_type="nf4")``,
    bit for bit, with its temporaries bounded to ``chunk`` elements.

    NF4 quantises every block of ``blocksize`` elements on its own (the block's absmax and its 4-bit
    codes), so quantising whole blocks a chunk at a time gives the same codes and absmax. Only the
    double quantisation of the absmax vector looks at all of it (its offset is the mean), and it runs
    once on the whole, small vector, as bitsandbytes does.
    """
    import bitsandbytes.functional as bnbf
    flat, chunk = weight.reshape(-1), chunk or CPU_QUANTIZE_CHUNK
    step = max(blocksize, chunk - chunk % blocksize)
    packed, absmax = [], []
    for start in range(0, flat.numel(), step):
        codes, block_absmax = torch.ops.bitsandbytes.quantize_4bit.default(
            flat[start:start + step], blocksize, "nf4", storage)
        packed.append(codes)
        absmax.append(block_absmax)
    packed = torch.cat(packed) if len(packed) > 1 else packed[0]
    absmax = torch.cat(absmax) if len(absmax) > 1 else absmax[0]
    offset = absmax.mean()
    quantised_absmax, state2 = bnbf.quantize_blockwise(absmax - offset, blocksize=256)
    return packed, bnbf.QuantState(absmax=quantised_absmax, shape=weight.shape, dtype=weight.dtype,
                                   blocksize=blocksize, code=bnbf.get_4bit_type("nf4", device=weight.device),
                                   quant_type="nf4", offset=offset, state2=state2)


def quantize_nf4(layer: nn.Module) -> nn.Module:
    return nf4_linear(layer.weight, layer.bias)


def dequantize_nf4(layer: nn.Module) -> torch.Tensor:
    """The float weight of an NF4/FP4 layer (``dequantize_4bit`` reads the type from the state)."""
    import bitsandbytes.functional as bnbf
    weight = layer.weight
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        # bitsandbytes' CPU inference path repacked it; the inverse rewrites quant_state in place,
        # so the data must be put back with it (as Params4bit.cuda() does)
        unpacked = bnbf._convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
        weight.data, weight.quant_state = unpacked
    return bnbf.dequantize_4bit(weight.data, weight.quant_state)


FLOAT_LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


def quantize_linears_nf4(module: nn.Module, _done: Optional[dict] = None) -> None:
    """Replace every float linear layer under ``module`` with an NF4 one, in place (QLoRA's base)."""
    from bitsandbytes.nn import Linear4bit
    done = {} if _done is None else _done  # id -> (old, new): a layer shared by two parents stays shared
    for name, child in list(module.named_children()):
        if id(child) in done:
            setattr(module, name, done[id(child)][1])
        elif isinstance(child, FLOAT_LINEARS) and not isinstance(child, Linear4bit):
            done[id(child)] = (child, quantize_nf4(child))
            setattr(module, name, done[id(child)][1])
        else:
            quantize_linears_nf4(child, done)


def qlora_run(args) -> bool:
    """A QLoRA run: upstream's ``--use_qlora``, or ``SAT_PATCHES_QLORA=1`` for scripts without it."""
    return bool(getattr(args, "use_qlora", False)) or os.environ.get("SAT_PATCHES_QLORA", "") not in ("", "0")


def qlora_base(model: nn.Module) -> List[nn.Module]:
    """The parts of a model whose float linears QLoRA makes NF4: the transformer and the mixins that
    extend it (CogVLM's vision experts, LLaMA's gate projections); not a mixin holding a model of its
    own (CogVLM's EVA vision tower), not the adapters, and not the LM head (``lm``), which QLoRA keeps
    in the run's dtype as it does the embeddings."""
    from sat.model.base_model import BaseModel
    roots = [model.transformer] if hasattr(model, "transformer") else []
    for name, mixin in getattr(model, "mixins", {}).items():
        if name not in ("lora", "lm") and not any(isinstance(m, BaseModel) for m in mixin.modules()):
            roots.append(mixin)
    return roots


def nf4_as_loaded(model: nn.Module, args):
    """For a QLoRA run, the loader's ``after`` callback that turns each float linear of
    :func:`qlora_base` into NF4 on the compute device as soon as it is loaded, so the float model
    never exists whole on the device: the peak is the NF4 model plus one linear in float
    (THUDM/CogVLM#438: QLoRA where LoRA runs out of GPU memory). The later ``LoraMixin(qlora=True)``
    wraps these NF4 bases as they are. The callback's ``converts(module)`` tells the loader which modules
    it converts (their weights are copied, not lent from the mapped file). None for other runs."""
    if not qlora_run(args) or not hasattr(model, "transformer"):
        return None
    if get_model_parallel_world_size() > 1:
        raise NotImplementedError("QLoRA with model_parallel_size > 1 is not supported: an NF4 base layer has no "
                                  "model-parallel forward; use MP_SIZE=1 (QLoRA fits CogVLM on one 24 GB GPU)")
    from bitsandbytes.nn import Linear4bit
    inside = {id(m) for root in qlora_base(model) for m in root.modules()}
    done: Dict[int, nn.Module] = {}  # a linear shared by two parents stays shared

    def converts(module) -> bool:
        """Whether ``module`` becomes NF4 once loaded (the loader copies its weights instead of lending them)."""
        return id(module) in inside and isinstance(module, FLOAT_LINEARS) and not isinstance(module, Linear4bit)

    def after(module, prefix):
        if not converts(module):
            return
        parent, _, name = prefix.rstrip(".").rpartition(".")
        if id(module) not in done:
            done[id(module)] = quantize_nf4(module)
        setattr(model.get_submodule(parent), name, done[id(module)])
    after.converts = converts
    return after


# --------------------------------------------------------------------------------------
# LoraMixin.reinit
# --------------------------------------------------------------------------------------

def lora_targets(layer, cross_attention: bool):
    """(owner, attribute, partition) of every linear layer LoRA wraps in a transformer layer."""
    yield layer.attention, "dense", 1
    yield layer.attention, "query_key_value", layer.attention.stride
    if cross_attention and layer.is_decoder:
        yield layer.cross_attention, "dense", 1
        yield layer.cross_attention, "query", 1
        yield layer.cross_attention, "key_value", 2


def _reinit(original):
    """THUDM/CogVLM#438: LoraMixin(qlora=True).reinit leaves the other linears float until a later ``.cuda()``."""
    def reinit(self, parent_model=None):
        from sat.model.finetune import lora2
        transformer = parent_model.transformer
        for i in self.layer_range:
            for owner, name, partition in lora_targets(transformer.layers[i], self.cross_attention):
                lin = getattr(owner, name)
                out_size, in_size = full_shape(lin)
                setattr(owner, name, lora2.replace_linear_with_lora(
                    lin, partition, self.r, self.lora_alpha, self.lora_dropout, qlora=self.qlora,
                    in_size=in_size, out_size=out_size))
        print_rank0(f"LoRA (r={self.r}{', NF4 base' if self.qlora else ''}) on layers {list(self.layer_range)}")
        if self.qlora:
            for root in qlora_base(parent_model):
                quantize_linears_nf4(root)
    return reinit


# --------------------------------------------------------------------------------------
# Model-parallel split / merge of LoRA layers in a state dict
# --------------------------------------------------------------------------------------

class LoraLayout(NamedTuple):
    kind: str  # "column" | "row" | "plain": the base layer's parallel type
    partition: Union[int, List[int]]  # SAT's partition: stacked outputs (3 for QKV) or their ratios


def is_lora_layer(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("matrix_A", "matrix_B", "original"))


def lora_layout(model: nn.Module) -> Dict[str, LoraLayout]:
    """``{module name: LoraLayout}`` for every LoRA layer of ``model`` (these patches' or stock SAT's)."""
    return {name: LoraLayout(getattr(m, "kind", None) or parallel_kind(m.original), m.partition)
            for name, m in model.named_modules() if is_lora_layer(m)}


def _rule(kind: str, suffix: str) -> str:
    factor = suffix.partition(".")[0]
    if factor in ("matrix_A", "matrix_B"):
        split = lora_factor_split(kind, factor)
        return "copy" if split is None else ("rows", "cols")[split.dim]
    if suffix == "original.weight":
        return {COLUMN: "segments", ROW: "cols"}.get(kind, "copy")
    if suffix == "original.bias":
        return "segments" if kind == COLUMN else "copy"
    raise ValueError(f"don't know how to split LoRA layer key '{suffix}' (QLoRA states are not supported)")


def _lora_keys(state_dict: Mapping, layout: Mapping[str, LoraLayout]):
    """(key, layout, rule) for every key of ``state_dict`` under a LoRA layer."""
    for key in state_dict:
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            owner = ".".join(parts[:cut])
            if owner in layout:
                yield key, layout[owner], _rule(layout[owner].kind, ".".join(parts[cut:]))
                break


def _even(t: torch.Tensor, n: int, dim: int) -> List[torch.Tensor]:
    if t.shape[dim] % n:
        raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor does not split into {n}")
    return list(t.split(t.shape[dim] // n, dim))


def _split(t: torch.Tensor, rule: str, n: int, partition) -> List[torch.Tensor]:
    if rule == "copy":
        return [t] * n
    if rule in ("rows", "cols"):
        return [p.clone() for p in _even(t, n, 0 if rule == "rows" else 1)]
    pieces = [_even(seg, n, 0) for seg in t.split(segment_sizes(t.shape[0], partition))]
    return [torch.cat([p[rank] for p in pieces]) for rank in range(n)]


def _merge(ts: Sequence[torch.Tensor], rule: str, partition) -> torch.Tensor:
    if rule == "copy":
        return ts[0]
    if rule in ("rows", "cols"):
        return torch.cat(list(ts), 0 if rule == "rows" else 1)
    segs = [t.split(segment_sizes(t.shape[0], partition)) for t in ts]
    return torch.cat([seg[i] for i in range(len(segs[0])) for seg in segs])


def _as_layout(layout) -> Mapping[str, LoraLayout]:
    return lora_layout(layout) if isinstance(layout, nn.Module) else layout


def split_lora_state_dict(state_dict: Mapping[str, torch.Tensor], layout,
                          mp_size: int) -> List[Dict[str, torch.Tensor]]:
    """Split the LoRA layers of an MP=1 state dict into ``mp_size`` per-rank state dicts.

    ``layout`` is a model with LoRA layers (any MP size; only its structure is read) or the dict
    :func:`lora_layout` returns. Returns one dict per model-parallel rank holding exactly the keys
    of ``state_dict`` under LoRA layers (``original.weight/bias``, ``matrix_A.i``, ``matrix_B.i``);
    every other key is the caller's. Split tensors are fresh copies; replicated ones are shared.
    """
    shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(mp_size)]
    for key, lay, rule in _lora_keys(state_dict, _as_layout(layout)):
        for shard, piece in zip(shards, _split(state_dict[key], rule, mp_size, lay.partition)):
            shard[key] = piece
    return shards


def merge_lora_state_dicts(state_dicts: Sequence[Mapping[str, torch.Tensor]],
                           layout) -> Dict[str, torch.Tensor]:
    """Merge the LoRA layers of per-rank state dicts (model-parallel rank order) into one MP=1 dict.

    The inverse of :func:`split_lora_state_dict`; replicated tensors are taken from rank 0. Returns
    only the keys under LoRA layers.
    """
    return {key: _merge([sd[key] for sd in state_dicts], rule, lay.partition)
            for key, lay, rule in _lora_keys(state_dicts[0], _as_layout(layout))}


# --------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------

def _expect_lora_linear(cls):
    return (expect_params("original_cls", "partition", "r", "original_obj")(cls.__init__)
            or expect_names("copy_to_model_parallel_region")(cls.forward))


def _lora_linear(original):
    """THUDM/CogVLM#283, #320 (base-layer copies), #328 (LoRA params on CPU), #438 (QLoRA NameError
    'dtype'); stock SAT's LoRA on a RowParallelLinear never all-reduces x @ A^T."""
    return LoraLinear


def _replace_linear_with_lora(original):
    """THUDM/CogVLM#268 (LoRA sized from in_size/out_size); meta bases: LoRA params moved to meta."""
    return replace_linear_with_lora


def _merge_linear_lora(original):
    """THUDM/CogVLM#117, #451 (merging MP LoRA), #257 (QLoRA merge assumes a bias): stock SAT returns a plain
    nn.Linear(...).cuda()."""
    return merge_linear_lora


PATCHES = [
    Patch("lora_linear", "sat.model.finetune.lora2:LoraLinear", _lora_linear,
          answers="LoRA by reference on the base weight's device/dtype; RowParallel LoRA all-reduces "
                  "x@A^T (stock SAT does not: model-parallel ranks disagree once B != 0); QLoRA NameError 'dtype' "
                  "(THUDM/CogVLM#438); CPU LoRA params under NCCL (THUDM/CogVLM#328); host-memory copies "
                  "(THUDM/CogVLM#283, #320)",
          expect=_expect_lora_linear),
    Patch("lora_replace", "sat.model.finetune.lora2:replace_linear_with_lora", _replace_linear_with_lora,
          answers="replace_linear_with_lora moves new LoRA params to the base's device (meta stays meta) "
                  "and sizes layers from in_size/out_size (THUDM/CogVLM#268)",
          expect=expect_params("lin", "partition", "r")),
    Patch("lora_merge", "sat.model.finetune.lora2:merge_linear_lora", _merge_linear_lora,
          answers="merge_linear_lora returns nn.Linear(...).cuda() (loses model parallelism), assumes a "
                  "bias for QLoRA (THUDM/CogVLM#257), dequantises NF4 with dequantize_fp4, full-size temporaries",
          expect=expect_names("dequantize_fp4", "cuda")),
    Patch("lora_reinit", "sat.model.finetune.lora2:LoraMixin.reinit", _reinit,
          answers="LoraMixin(qlora=True).reinit leaves the transformer's linears float and unquantised, "
                  "cloning each (THUDM/CogVLM#438)",
          expect=expect_names("replace_linear_with_lora", "HackLinearNF4")),
]

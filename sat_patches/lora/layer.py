"""LoRA layers for SwissArmyTransformer (``sat/model/finetune/lora2.py``): by reference, on the right device,
correct under model parallelism; merged in place.

The base layer is kept (same Parameter); ``matrix_A/B`` follow its device, dtype and parallel layout (column:
B split; row: A split and ``x @ A^T`` all-reduced). :func:`merge_linear_lora` adds ``B @ A`` to the base weight
in row chunks of at most :data:`CHUNK_BYTES` and returns the base layer. State-dict keys are stock SAT's.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from sat.helpers import print_rank0

from sat.model.finetune import lora2
from sat.mpu import mappings
from sat.mpu.initialize import get_model_parallel_world_size
from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from ..checkpoints.lora_names import BASE, FACTORS
from ..checkpoints.sharding import COLUMN, PLAIN, ROW, lora_factor_split, parallel_kind
from ..core import settings
from ..runtime import devices
from .qlora import dequantize_nf4, nf4_linear, qlora_base, quantize_linears_nf4, quantize_nf4

CHUNK_BYTES = int(settings.read("SAT_PATCHES_LORA_CHUNK_MB") * 2**20)
"""Largest temporary (bytes) of a LoRA merge; ``SAT_PATCHES_LORA_CHUNK_MB`` sets it (default 64)."""

def full_shape(layer: nn.Module):
    """(out_features, in_features) of ``layer`` over all model-parallel ranks."""
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        return layer.output_size, layer.input_size
    if _is_nf4(layer):  # its weight is packed
        return layer.out_features, layer.in_features
    return tuple(layer.weight.shape)


def segment_sizes(rows: int, partition) -> List[int]:
    """Row counts of the stacked outputs (e.g. Q, K, V): ``partition`` equal parts, or a list of ratios."""
    ratios = [1] * partition if isinstance(partition, int) else list(partition)
    if rows % sum(ratios):
        raise ValueError(f"{rows} rows cannot be split in the ratios {ratios}")
    return [rows // sum(ratios) * k for k in ratios]


def _beside(weight: torch.Tensor, *shape: int) -> torch.Tensor:
    """An uninitialised tensor beside ``weight``; on the compute device when ``weight`` is on meta."""
    device = devices.compute_device()
    if weight.device.type == "meta" and device.type != "meta":
        return torch.empty(shape, dtype=weight.dtype, device=device)
    return weight.new_empty(shape)


def _is_nf4(layer: nn.Module) -> bool:
    return getattr(getattr(layer, "weight", None), "quant_type", None) in ("nf4", "fp4")


class LoraLinear(nn.Module):
    """``original(x) + scaling * B(A(dropout(x)))``, with ``original`` kept by reference. SAT's constructor;
    ``partition``: the number (or ratios) of stacked outputs of the base layer, each with its own A and B."""

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
        # a base still on meta (a model that adds QLoRA in its constructor) is quantised as it loads
        on_meta = original_obj.weight.device.type == "meta"
        self.original = quantize_nf4(original_obj) if qlora and not nf4_base and not on_meta else original_obj

        out_features, in_features = full_shape(original_obj) if nf4_base else weight.shape  # this rank's slice
        rows = segment_sizes(out_features, partition)
        self.matrix_A = nn.ParameterList(nn.Parameter(_beside(weight, r, in_features)) for _ in rows)
        self.matrix_B = nn.ParameterList(nn.Parameter(_beside(weight, n, r)) for n in rows)
        for factor in FACTORS:
            split = lora_factor_split(self.kind, factor) is not None
            for p in getattr(self, factor):  # SAT syncs by these flags; DeepSpeed counts unsplit norms once
                p.model_parallel = p.tensor_model_parallel = split
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.original(x)
        x = self.lora_dropout(x)
        parallel = self.kind != PLAIN and get_model_parallel_world_size() > 1  # (at one rank the maps are identities)
        if parallel and self.kind == ROW and not self.input_is_parallel:
            x = mappings.scatter_to_model_parallel_region(x)
        # the partitions' A in one product: x @ [A_0; A_1; ...]^T is [x @ A_0^T, x @ A_1^T, ...]
        a = self.matrix_A[0] if len(self.matrix_A) == 1 else torch.cat(list(self.matrix_A))
        xa = x @ a.t()
        if parallel and self.kind == ROW:  # x and A are this rank's slices: their products add up to x @ A^T
            xa = mappings.reduce_from_model_parallel_region(xa)
        elif parallel and self.kind == COLUMN:  # backward: dL/d(xA^T) sums over the output slices of all ranks
            xa = mappings.copy_to_model_parallel_region(xa)
        if len(self.matrix_B) == 1:
            lora = xa @ self.matrix_B[0].t()
        else:
            lora = torch.cat([part @ b.t() for part, b in zip(xa.split(self.r, -1), self.matrix_B)], -1)
        if parallel and self.kind == COLUMN and self.gather_output:
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
    """Wrap ``lin`` in a LoRA layer; ``in_size``/``out_size`` are ignored for the layer's own full shape."""
    kw_args.pop("in_size", None)
    kw_args.pop("out_size", None)
    out_dim, in_dim = full_shape(lin)
    return lora2.LoraLinear(type(lin), partition, in_dim, out_dim, r, *args, original_obj=lin, **kw_args)


@torch.no_grad()
def add_lora_product(weight: torch.Tensor, lin: nn.Module, chunk_bytes: Optional[int] = None) -> None:
    """``weight[segment i] += scaling * B_i @ A_i`` in place, summed in fp32, ``chunk_bytes`` of rows at a time."""
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
    """Fold the LoRA product into the base layer and return it (an NF4 base: dequantised, summed, requantised)."""
    base = lin.original
    if not _is_nf4(base):
        add_lora_product(base.weight, lin, chunk_bytes)
        return base
    weight = dequantize_nf4(base)
    add_lora_product(weight, lin, chunk_bytes)
    return nf4_linear(weight, base.bias)


def lora_targets(layer, cross_attention: bool):
    """(owner, attribute, partition) of every linear layer LoRA wraps in a transformer layer."""
    yield layer.attention, "dense", 1
    yield layer.attention, "query_key_value", layer.attention.stride
    if cross_attention and layer.is_decoder:
        yield layer.cross_attention, "dense", 1
        yield layer.cross_attention, "query", 1
        yield layer.cross_attention, "key_value", 2


def is_lora_layer(module: nn.Module) -> bool:
    """A LoRA layer: this package's :class:`LoraLinear` or stock SAT's (both keep ``original``, ``matrix_A``, ``matrix_B``)."""
    return all(hasattr(module, name) for name in (BASE, *FACTORS))


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers already (a model class that adds LoRA in its constructor)."""
    return any(is_lora_layer(m) for m in model.modules())


def reinit_lora_mixin(mixin, parent_model) -> None:
    """SAT's ``LoraMixin.reinit`` with QLoRA quantises the other linears only at a later ``.cuda()``
    (THUDM/CogVLM#438): here they are quantised to NF4 at once."""
    transformer = parent_model.transformer
    for i in mixin.layer_range:
        for owner, name, partition in lora_targets(transformer.layers[i], mixin.cross_attention):
            lin = getattr(owner, name)
            out_size, in_size = full_shape(lin)
            setattr(owner, name, lora2.replace_linear_with_lora(
                lin, partition, mixin.r, mixin.lora_alpha, mixin.lora_dropout, qlora=mixin.qlora,
                in_size=in_size, out_size=out_size))
    print_rank0(f"LoRA (r={mixin.r}{', NF4 base' if mixin.qlora else ''}) on layers {list(mixin.layer_range)}")
    if mixin.qlora:
        for root in qlora_base(parent_model):
            quantize_linears_nf4(root)

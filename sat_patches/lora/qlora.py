"""QLoRA: bitsandbytes NF4 base layers under LoRA, quantised on their own device, one linear at a time
(stock ``LoraMixin(qlora=True)`` raised ``NameError`` on ``dtype`` and merged NF4 with ``dequantize_fp4``:
THUDM/CogVLM#438, #257).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import bitsandbytes.functional as bnbf
import torch
from bitsandbytes.nn import Linear4bit, LinearNF4, Params4bit
from sat.model.base_model import BaseModel
from sat.mpu.initialize import get_model_parallel_world_size
from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from ..core import settings

# elements quantised at a time on CPU (bitsandbytes' CPU quantize_4bit holds ~11 bytes of temporaries per element)
CPU_QUANTIZE_CHUNK = 2 ** 20


def nf4_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Module:
    """A bitsandbytes ``LinearNF4`` holding ``weight`` quantised on its own device; ``bias`` by reference."""
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
    """``bitsandbytes.functional.quantize_4bit(..., compress_statistics=True, quant_type="nf4")`` bit for bit,
    whole blocks ``chunk`` elements at a time; the absmax vector is double-quantised once, whole."""
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
    done = {} if _done is None else _done  # id -> (old, new): a layer shared by two parents stays shared
    for name, child in list(module.named_children()):
        if id(child) in done:
            setattr(module, name, done[id(child)][1])
        elif isinstance(child, FLOAT_LINEARS) and not isinstance(child, Linear4bit):
            if child.weight.is_meta:  # built on meta: the streamed loader quantises it as it arrives
                continue
            done[id(child)] = (child, quantize_nf4(child))
            setattr(module, name, done[id(child)][1])
        else:
            quantize_linears_nf4(child, done)


def qlora_run(args) -> bool:
    """A QLoRA run: upstream's ``--use_qlora``, or ``SAT_PATCHES_QLORA=1`` for scripts without it."""
    return bool(getattr(args, "use_qlora", False)) or settings.read("SAT_PATCHES_QLORA")


def qlora_base(model: nn.Module) -> List[nn.Module]:
    """The parts whose float linears QLoRA makes NF4: the transformer and the mixins extending it; not a mixin
    holding a model of its own (EVA), the adapters, or the LM head."""
    roots = [model.transformer] if hasattr(model, "transformer") else []
    for name, mixin in getattr(model, "mixins", {}).items():
        if name not in ("lora", "lm") and not hasattr(mixin, "lm_head") \
                and not any(isinstance(m, BaseModel) for m in mixin.modules()):
            roots.append(mixin)
    return roots


def nf4_as_loaded(model: nn.Module, args):
    """For a QLoRA run, the loader's ``after`` callback that makes each float linear of :func:`qlora_base` NF4
    as soon as it is loaded, so the float model never exists whole on the device (THUDM/CogVLM#438); its
    ``converts(module)`` names the modules it converts. None for other runs."""
    qlora_mixin = any(getattr(m, "qlora", False) for m in getattr(model, "mixins", {}).values())
    if not (qlora_run(args) or qlora_mixin) or not hasattr(model, "transformer"):
        return None
    if get_model_parallel_world_size() > 1:
        raise NotImplementedError("QLoRA with model_parallel_size > 1 is not supported: an NF4 base layer has no "
                                  "model-parallel forward; use MP_SIZE=1 (QLoRA fits CogVLM on one 24 GB GPU)")
    inside = {id(m) for root in qlora_base(model) for m in root.modules()}
    done: Dict[int, nn.Module] = {}  # a linear shared by two parents stays shared

    def converts(module) -> bool:
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



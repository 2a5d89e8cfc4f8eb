"""Where and how new parameters of the CogVLM parts are made: every part takes ``params_dtype``, ``device``
and ``skip_init`` (upstream builds fp32 on the host), so all parameters of one model start where its SAT
transformer was built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from sat.mpu.utils import unscaled_init_method


@dataclass(frozen=True)
class Placement:
    """dtype/device/skip_init for new parameters, plus the init methods used when not skipping."""

    params_dtype: torch.dtype
    device: torch.device
    skip_init: bool = False
    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None

    @classmethod
    def resolve(cls, params_dtype=None, device=None, skip_init=False, init_method=None,
                output_layer_init_method=None) -> "Placement":
        """Fill what the caller left out from torch's defaults (so ``with torch.device(...)`` and
        ``torch.set_default_dtype`` are honoured) instead of hard-coding CPU fp32."""
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        dev = torch.device(device) if device is not None else torch.get_default_device()
        init = init_method or unscaled_init_method(0.02)
        return cls(dtype, dev, bool(skip_init), init, output_layer_init_method or init)

    @classmethod
    def of_transformer(cls, transformer, skip_init: bool) -> "Placement":
        """The placement a SAT ``BaseTransformer`` was built with (its word embedding's dtype and device)."""
        weight = transformer.word_embeddings.weight
        return cls(weight.dtype, weight.device, bool(skip_init), transformer.init_method,
                   transformer.output_layer_init_method)

    @property
    def factory(self) -> dict:
        return {"dtype": self.params_dtype, "device": self.device}

    def parallel_kwargs(self, output_layer: bool = False) -> dict:
        """Keyword arguments for SAT's Column/RowParallelLinear."""
        return {"params_dtype": self.params_dtype, "device": self.device, "skip_init": self.skip_init,
                "init_method": self.output_layer_init_method if output_layer else self.init_method}


def make_module(placement: Placement, module_cls, *args, **kwargs) -> nn.Module:
    """Build a torch module (``nn.Linear``, ``nn.Conv2d``, ``nn.LayerNorm``, ...) directly in the
    placement's dtype/device; with ``skip_init`` its weights are left uninitialised (to be loaded)."""
    if placement.skip_init:
        return torch.nn.utils.skip_init(module_cls, *args, **kwargs, **placement.factory)
    return module_cls(*args, **kwargs, **placement.factory)


def zeros_parameter(placement: Placement, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, **placement.factory))

"""One construction context: SAT models, layers and mixins are built on the compute device, in the run's dtype,
so a rank never holds a full fp32 CPU copy of the model (THUDM/CogVLM#283, #320). SAT builds on CPU in fp32
wherever no ``device``/``params_dtype`` is passed down; :func:`sat_patches.runtime.construction.build_on` is
entered around every SAT model construction, ``BaseModel.add_mixin`` and ``BaseModel.reinit``.
"""
from __future__ import annotations

import functools
from typing import Optional

from sat.helpers import check_if_zero3

from ..core.registry import Patch, expect_params
from ..runtime import devices
from ..runtime.construction import build_on, current_build, model_dtype, move_to_build, run_dtype


def _model_args(args, kwargs):
    return args[0] if args else kwargs.get("args")


def _construct_model(original):
    """``SomeModel(args, ...)`` for every SAT model class: built inside
    :func:`~sat_patches.runtime.construction.build_on`, in the dtype its ``params_dtype``/``dtype`` keyword or
    ``args`` name."""
    def __call__(cls, *args, **kwargs):
        sat_args = _model_args(args, kwargs)
        if current_build() is not None or (sat_args is not None and check_if_zero3(sat_args)):
            return original(cls, *args, **kwargs)  # nested, or DeepSpeed zero.Init places params
        told = kwargs.get("params_dtype", kwargs.get("dtype"))  # CogVideoX's DiT is told by keyword: dtype="bf16"
        with build_on(devices.compute_device(), run_dtype(sat_args, told)):
            return original(cls, *args, **kwargs)
    return __call__


def _add_mixin(original):
    """A mixin built before ``add_mixin`` (outside any model) joins the model's device and dtype;
    what its ``reinit`` allocates (LoRA layers) is built there too."""
    @functools.wraps(original)
    def add_mixin(self, name, new_mixin, reinit=False):
        with build_on(devices.compute_device(), model_dtype(self)) as target:
            move_to_build(new_mixin, target)
            return original(self, name, new_mixin, reinit=reinit)
    return add_mixin


def _reinit(original):
    """``load_checkpoint`` re-initialises mixins whose keys a checkpoint lacks (LoRA builds layers)."""
    @functools.wraps(original)
    def reinit(self, mixin_names=None):
        with build_on(devices.compute_device(), model_dtype(self)):
            return original(self, mixin_names)
    return reinit


def _expect_type_call(original) -> Optional[str]:
    return None if original is type.__call__ else "MetaModel defines its own __call__"


PATCHES = [
    Patch("build_models_on_device", "sat.model.registry:MetaModel.__call__", _construct_model,
          answers="THUDM/CogVLM#283, #320: BaseModel builds on CPU in fp32 (device=torch.device('cpu'), mixins "
                  "without params_dtype) before get_model casts and moves: a full fp32 CPU copy per rank",
          expect=_expect_type_call),
    Patch("add_mixin_on_device", "sat.model.base_model:BaseModel.add_mixin", _add_mixin,
          answers="THUDM/CogVLM#283, #320: mixins built with device=torch.device('cpu'), fp32 (vision-expert "
                  "mixins, LoRA) stay on CPU in fp32",
          expect=expect_params("name", "new_mixin", "reinit")),
    Patch("reinit_on_device", "sat.model.base_model:BaseModel.reinit", _reinit,
          answers="THUDM/CogVLM#283, #320: layers a mixin's reinit builds (LoRA via load_checkpoint) land on CPU",
          expect=expect_params("mixin_names")),
]

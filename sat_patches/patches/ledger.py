"""The memory ledger: every rank records its host RSS and CUDA memory at each phase of a SAT run (start, build,
load, split, lora, deepspeed_init, first_step, step); rank 0 prints the per-rank table, writes it to the run
directory (``memory_ledger.csv``/``.json``) and flags a rank far above the others
(:mod:`sat_patches.diagnostics.ledger`). ``SAT_PATCHES_LEDGER=0`` turns recording off.
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, delegate, expect_names, expect_params
from ..diagnostics.ledger import LEDGER, train_step_recorded


def _recording(phase: str, once: bool = False):
    """Wrap a function (or classmethod) so that :data:`LEDGER` records ``phase`` when it returns."""
    def make(original):
        func = original.__func__ if isinstance(original, classmethod) else original

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with LEDGER.phase(phase, once):
                return func(*args, **kwargs)
        return classmethod(wrapper) if isinstance(original, classmethod) else wrapper
    return make


def _answers(what):
    return f"memory ledger (stock SAT reports no per-rank memory): {what}"


def _add_mixin(original):
    """``BaseModel.add_mixin``: record "lora" once a LoRA mixin was added and injected (reinit)."""
    @functools.wraps(original)
    def add_mixin(self, name, new_mixin, reinit=False):
        if not (reinit and "lora" in type(new_mixin).__name__.lower()):
            return original(self, name, new_mixin, reinit=reinit)
        with LEDGER.phase("lora"):
            return original(self, name, new_mixin, reinit=reinit)
    return add_mixin


PATCHES = [
    Patch("ledger_build", "sat.model.registry:MetaModel.__call__", _recording("build"),
          answers=_answers("host/CUDA memory once a SAT model is built (THUDM/CogVLM#283: killed while building)")),
    Patch("ledger_lora", "sat.model.base_model:BaseModel.add_mixin", _add_mixin,
          answers=_answers("memory once LoRA layers are injected (stock lora2 copies every base layer)"),
          expect=expect_params("name", "new_mixin", "reinit")),
    Patch("ledger_start", "sat.arguments:initialize_distributed", _recording("start", once=True),
          answers=_answers("baseline after imports and process-group set-up"),
          expect=expect_names("init_process_group")),
    Patch("ledger_load", "sat.training.model_io:load_checkpoint", _recording("load"),
          answers=_answers("memory after a checkpoint load (THUDM/CogVLM#320: RAM twice the model)"),
          expect=expect_params("model", "args")),
    Patch("ledger_from_pretrained", "sat.model.base_model:BaseModel.from_pretrained", _recording("load"),
          answers=_answers("memory after from_pretrained (build + load + MP split)"),
          expect=expect_params("name", "args")),
    Patch("ledger_split_rank0", "sat.mpu.operation:mp_split_model_rank0", _recording("split"),
          answers=_answers("node rank 0 holding the full model while it sends partitions "
                           "(THUDM/SwissArmyTransformer#173)"),
          expect=expect_names("broadcast")),
    Patch("ledger_split_receive", "sat.mpu.operation:mp_split_model_receive", _recording("split"),
          answers=_answers("ranks receiving their partition (THUDM/SwissArmyTransformer#173)"),
          expect=expect_names("broadcast")),
    Patch("ledger_deepspeed_init", "sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer",
          _recording("deepspeed_init"),
          answers=_answers("memory after parameter sync and deepspeed.initialize (optimizer states)"),
          expect=expect_names("initialize")),
    Patch("ledger_train_step", "sat.training.deepspeed_training:train_step", delegate(train_step_recorded),
          answers=_answers("first step and every log interval; rank 0 prints/writes the table, flags outliers"),
          expect=expect_params("data_iterator", "model", "optimizer", "lr_scheduler", "args", "timers")),
]

"""Process group and argument patches: a backend for CPU tensors (THUDM/CogVLM#328,
THUDM/SwissArmyTransformer#173), and SAT's CPU device check.
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, delegate, expect_names, expect_params
from ..runtime.distributed import (explained_collectives, get_args_on_compute_device,
                                   initialize_distributed_destroyed_at_exit, initialize_distributed_with_backend,
                                   training_device,)


def _training_main(original):
    """sat training_main: moves a passed-in model to ``args.device`` (CPU on the QLoRA demo path)."""
    @functools.wraps(original)
    def training_main(args, model_cls, *a, **kw):
        args.device = training_device(args, model_given=not isinstance(model_cls, type))
        return original(args, model_cls, *a, **kw)
    return training_main


def _setup_with_explained_sync(original):
    """SAT's "Syncing initialized parameters" broadcast: name the parameter when it has no backend."""
    @functools.wraps(original)
    def setup_model_untrainable_params_and_optimizer(args, model, config_params=None):
        module = getattr(model, "module", model)
        with explained_collectives(
                "SAT's 'Syncing initialized parameters' (sat/training/deepspeed_training.py "
                "setup_model_untrainable_params_and_optimizer)", module.named_parameters):
            return original(args, model, config_params)
    return setup_model_untrainable_params_and_optimizer


PATCHES = [
    Patch("process_group_backend", "sat.arguments:initialize_distributed",
          delegate(initialize_distributed_with_backend),
          answers="THUDM/CogVLM#328, THUDM/SwissArmyTransformer#173: No backend type associated with device type cpu",
          expect=expect_names("init_process_group", "distributed_backend")),
    Patch("destroy_group_at_exit", "sat.arguments:initialize_distributed",
          delegate(initialize_distributed_destroyed_at_exit),
          answers="SAT never destroys its process group: gloo aborts the process at interpreter exit "
                  "(pytorch/pytorch#190489)",
          expect=expect_names("init_process_group")),
    Patch("explain_sync_collective",
          "sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer",
          _setup_with_explained_sync,
          answers="THUDM/CogVLM#328: the NCCL error does not say which tensor or SAT call; name both",
          expect=expect_names("broadcast")),
    Patch("training_main_device", "sat.training.deepspeed_training:training_main", _training_main,
          answers="QLoRA demo sets args.device='cpu'; training_main (THUDM/SwissArmyTransformer@5385db0) then "
                  "moves the model to CPU",
          expect=expect_names("device")),
    Patch("get_args_cpu_device", "sat.arguments:get_args", delegate(get_args_on_compute_device),
          answers="get_args: 'LOCAL_RANK (default 0) and args.device inconsistent' without CUDA",
          expect=expect_params("args_list", "parser")),
]

"""DeepSpeed configs checked before DeepSpeed reads them: values DeepSpeed 0.19 rejects, offload blocks in
the wrong place, batch sizes that do not divide.
"""
from __future__ import annotations

import argparse
import json
import warnings
from typing import Optional

from ..checkpoints import safe_load
from ..core.registry import SatPatchesWarning
from . import devices


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot be fixed safely; the message says what to change."""


def lint_deepspeed_config(config: dict, world_size: Optional[int] = None, model_parallel_size: int = 1,
                          batch_size: Optional[int] = None) -> dict:
    """Fix with a warning, or refuse with :class:`DeepSpeedConfigError`: a non-integer ``fp16.min_loss_scale``;
    a top-level ``offload_optimizer``/``offload_param`` (moved into ``zero_optimization``, dropped on CPU ranks);
    batch sizes that do not multiply out; Adam without CUDA (``torch_adam``: no compiled optimizer);
    ``checkpoint.load_universal`` unless checkpoints are trusted (DeepSpeed unpickles them in full)."""
    if (config.get("checkpoint") or {}).get("load_universal") and not safe_load.trusted():
        raise DeepSpeedConfigError(
            f"DeepSpeed config: checkpoint.load_universal is true; DeepSpeed unpickles universal checkpoints in "
            f"full, which runs any code a file names. Remove it, or set {safe_load.TRUST_ENV}=1 if you trust "
            f"whoever made the checkpoints you load")
    _min_loss_scale(config)
    for key, stage in (("offload_optimizer", 1), ("offload_param", 3)):
        _place_offload(config, key, stage)
    _batch_sizes(config, world_size, model_parallel_size, batch_size)
    optimizer = config.get("optimizer") or {}
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer")
    if (devices.compute_device().type != "cuda" and not offload
            and str(optimizer.get("type", "")).lower() in ("adam", "adamw")):
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    return config


def _warn(message: str) -> None:
    warnings.warn(f"DeepSpeed config: {message}", SatPatchesWarning, stacklevel=4)


def _min_loss_scale(config: dict) -> None:
    fp16 = config.get("fp16") or {}
    scale = fp16.get("min_loss_scale")
    if scale is not None and not isinstance(scale, int):
        fixed = max(1, int(scale))
        _warn(f"fp16.min_loss_scale={scale!r} is not an integer (DeepSpeed rejects it); using {fixed}")
        fp16["min_loss_scale"] = fixed


def _place_offload(config: dict, key: str, needs_stage: int) -> None:
    if key not in config:
        return
    zero = config.get("zero_optimization")
    stage = int((zero or {}).get("stage", 0))
    if zero is not None and key in zero:
        _warn(f"a top-level '{key}' is ignored by DeepSpeed and zero_optimization.{key} is already set "
              f"({zero[key]}); dropping the top-level one ({config[key]})")
        del config[key]
    elif devices.compute_device().type != "cuda":
        _warn(f"'{key}' is at the top level, where DeepSpeed ignores it; dropped: on CPU ranks offloading to "
              f"the CPU changes nothing (and would compile DeepSpeed's CPU Adam)")
        del config[key]
    elif stage >= needs_stage:
        zero[key] = config.pop(key)
        _warn(f"'{key}' was at the top level, where DeepSpeed ignores it; moved into zero_optimization "
              f"(stage {stage}), where it takes effect: {zero[key]} (its states now live in host memory)")
    else:
        raise DeepSpeedConfigError(
            f"DeepSpeed config: '{key}' is at the top level, where DeepSpeed ignores it; it belongs in "
            f"zero_optimization and takes effect from ZeRO stage {needs_stage} (this config: stage {stage}). "
            f"Set zero_optimization.stage to {2 if needs_stage == 1 else 3} and move the "
            f"'{key}' block into zero_optimization, or delete it.")


def _batch_sizes(config: dict, world_size: Optional[int], mp: int, batch_size: Optional[int]) -> None:
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    for name in names:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DeepSpeedConfigError(f"DeepSpeed config: {name}={value!r} must be a positive integer.")
    if not world_size:
        return
    mp = mp or 1
    if world_size % mp:
        raise DeepSpeedConfigError(
            f"model-parallel size {mp} does not divide the {world_size} ranks: set MP_SIZE (--model-parallel-size) "
            f"to one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}, or change the GPU count.")
    dp = world_size // mp
    micro, accumulation, total = (config.get(n) for n in names)
    if micro is None and batch_size:
        config["train_micro_batch_size_per_gpu"] = micro = batch_size
        _warn(f"no train_micro_batch_size_per_gpu; SAT's data loader gives each rank {batch_size} samples "
              f"(--batch-size), so that is the micro-batch")
    if total is None or micro is None:
        return
    expected = micro * (accumulation or 1) * dp
    if accumulation is None and total % (micro * dp) == 0:
        return  # DeepSpeed derives gradient_accumulation_steps = total / (micro x dp)
    if total != expected:
        fits = f"{total // (micro * dp)}" if total % (micro * dp) == 0 else None
        raise DeepSpeedConfigError(
            f"DeepSpeed config: train_batch_size={total} but train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={accumulation or 1} x {dp} data-parallel rank(s) ({world_size} ranks / "
            f"model-parallel size {mp}) = {expected}. Delete train_batch_size (DeepSpeed derives it) or set it "
            f"to {expected}" + (f", or set gradient_accumulation_steps to {fits}." if fits else "."))


def deepspeed_config_path(args_list=None) -> Optional[str]:
    """The ``--deepspeed_config`` (or ``--deepspeed-config``) path of ``args_list`` (else ``sys.argv``)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--deepspeed_config", "--deepspeed-config")
    try:
        return parser.parse_known_args(args_list)[0].deepspeed_config
    except argparse.ArgumentError:  # the flag without a path
        return None


def get_args_naming_bad_json(original, args_list=None, parser=None):
    """SAT's ``get_args`` fails on a bad ``--deepspeed_config`` with a bare ``JSONDecodeError``: here a
    :class:`DeepSpeedConfigError` naming the file and line."""
    try:
        return original(args_list, parser)
    except json.JSONDecodeError as exc:
        path = deepspeed_config_path(args_list) or "--deepspeed_config"
        raise DeepSpeedConfigError(
            f"DeepSpeed config '{path}' is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}: "
            f"fix that line (JSON has no comments, no trailing commas, and needs double quotes)") from exc


def initialize_distributed_linted(original, args):
    """SAT's and upstream's configs hold settings DeepSpeed 0.19 rejects or ignores: linted
    (:func:`lint_deepspeed_config`) before SAT's ``initialize_distributed`` hands them on."""
    if isinstance(getattr(args, "deepspeed_config", None), dict):
        lint_deepspeed_config(args.deepspeed_config, getattr(args, "world_size", None),
                              getattr(args, "model_parallel_size", 1), getattr(args, "batch_size", None))
    return original(args)

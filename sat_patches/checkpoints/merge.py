"""Merge a model-parallel LoRA checkpoint into one MP=1 checkpoint with the LoRA folded in (``sat-patches merge``).

One process, no GPU: the model is built on meta, filled from the memory-mapped shards (model-parallel slices
joined), LoRA folded in by SAT's ``merge_linear_lora``, and written atomically (:mod:`.writer`). Stock SAT's
``mp_merge_model_rank0`` fails on LoRA checkpoints (THUDM/CogVLM#117, THUDM/CogVLM#451).
"""
from __future__ import annotations

import importlib
import math
import os
from typing import List

import torch
from sat.arguments import _simple_init
from sat.model.finetune import lora2  # its functions looked up at call time: patched or replaced
from sat.model.registry import model_registry

from . import adapter, files, sharding, writer
from .files import CheckpointError
from .lora_names import FACTOR_A, FACTOR_B, is_adapter, lora_layers
from .model_config import read_model_config
from .state import load_state, meta_tensors
from ..core import coordination
from ..lora.layer import is_lora_layer
from ..runtime import construction

class MergeError(CheckpointError):
    """A checkpoint ``merge`` cannot merge, or an output it would not overwrite; says what to change."""


def _partition(state: dict, path: str, count: int):
    """SAT's ``partition`` argument: a count when the parts are equal, else their relative sizes."""
    rows = [state[f"{path}.{FACTOR_B}.{i}"].shape[0] for i in range(count)]
    if len(set(rows)) == 1:
        return count
    g = math.gcd(*rows)
    return [r // g for r in rows]


def inject_lora(model: torch.nn.Module, state: dict, lora_alpha: float) -> List[str]:
    """Wrap every layer that has LoRA weights in ``state`` (SAT's ``replace_linear_with_lora``); a layer the
    model class already wrapped in its constructor (with its own rank and ``lora_alpha``) is kept as it is."""
    paths = []
    for path, count in sorted(lora_layers(state).items()):
        r = state[f"{path}.{FACTOR_A}.0"].shape[0]
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if not is_lora_layer(getattr(parent, name)):
            layer = getattr(parent, name)
            setattr(parent, name, lora2.replace_linear_with_lora(layer, _partition(state, path, count), r, lora_alpha))
        paths.append(path)
    return paths


def fold_lora(model: torch.nn.Module, paths: List[str]) -> None:
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, lora2.merge_linear_lora(getattr(parent, name)))


def float_dtype(tensors) -> torch.dtype:
    """The dtype of the first floating-point tensor among ``tensors`` (a checkpoint's), else float32."""
    return next((t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()), torch.float32)


def model_class(name: str, imports=()):
    """The registered SAT model class ``name``; ``imports`` are modules that register it (upstream
    CogVLM's ``utils.models``); sat_patches' own CogVLM/CogAgent are tried last."""
    for module in [*imports, "sat_patches.cogvlm.models", None]:
        try:
            return model_registry.get(name)
        except ValueError:
            if module is None:
                raise MergeError(f"model_class {name} (model_config.json) is not a registered SAT model: pass "
                                 f"--import MODULE for the module that defines it") from None
            importlib.import_module(module)


def build_args(config: dict, dtype: torch.dtype, imports=()):
    cls = model_class(config["model_class"], imports)
    args = cls.get_args()
    for key, value in config.items():
        setattr(args, key, value)
    args.model_parallel_size = 1
    args.skip_init, args.use_gpu_initialization, args.mode = True, False, "inference"
    args.fp16, args.bf16 = dtype == torch.float16, dtype == torch.bfloat16
    args.device = "cpu"
    # the single-process settings a training run's args carry, which some mixins read when they build
    # (upstream CogVLM's ImageMixin builds EVA from them)
    for key, value in (("world_size", 1), ("rank", 0), ("local_rank", 0), ("deepspeed", False)):
        if not hasattr(args, key):
            setattr(args, key, value)
    return cls, args


def adapter_base(ckpt, checkpoint: str):
    """The mapped shards of the base an adapter-only save names (checked against its fingerprint), or None."""
    manifest = adapter.read_manifest(os.path.dirname(ckpt.files[0]))
    return None if manifest is None else sharding.ShardedSource(adapter.base_checkpoint(manifest, checkpoint))


def merge(checkpoint: str, out_dir: str, lora_alpha: float = 1.0, iteration=None, overwrite: bool = False,
          imports=()) -> dict:
    """Merge ``checkpoint`` (any model-parallel size, LoRA or not) into an MP=1 checkpoint at
    ``out_dir`` with the LoRA products folded into the base weights. Raises :class:`MergeError` /
    :class:`CheckpointError` for input it cannot use. Returns what was merged."""
    if os.path.exists(out_dir) and not overwrite:
        raise MergeError(f"{out_dir} exists; choose a new OUTPUT_DIR or pass --overwrite")
    ckpt = files.find_checkpoint(checkpoint, iteration)
    config = read_model_config(checkpoint, need_class=True)
    with coordination.stage(f"reading {ckpt.mp_size} shard(s) of {checkpoint}"):
        source = sharding.ShardedSource(ckpt)
    state = source.state[0]
    base = adapter_base(ckpt, checkpoint)  # an adapter-only save: its base's shards
    dtype = float_dtype((base.state[0] if base else state).values())
    cls, args = build_args(config, dtype, imports)
    _simple_init(model_parallel_size=1, seed=1)
    with construction.build_on("meta", dtype):
        model = cls(args, params_dtype=dtype)
    if base:
        load_state(model, base)  # the base first, then LoRA around it, then the adapters
    paths = inject_lora(model, state, lora_alpha)
    missing, unexpected = load_state(model, source)
    if base:
        missing = [k for k in missing if is_adapter(k)] + meta_tensors(model)
    if missing or unexpected:
        raise MergeError(f"{checkpoint} does not fit {config['model_class']}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    fold_lora(model, paths)
    out_config = dict(config, model_parallel_size=1)
    if "use_lora" in out_config:
        out_config["use_lora"] = False
    with writer.new_dir(out_dir, writer.publish_checkpoint_dir) as tmp:
        writer.write_layout(tmp, 1, {0: {"module": model.state_dict(), "iteration": 1}}, out_config)
    return {"shards": ckpt.mp_size, "lora_layers": len(paths), "iteration": ckpt.iteration}

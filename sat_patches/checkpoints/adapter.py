"""Adapter-only checkpoints: a LoRA run saves its adapters, and names the base they belong to.

An adapter-only save keeps SAT's layout with only the trained parameters in ``module`` and writes
``<run>/<N>/adapter.json`` beside the shards: the base checkpoint's path, iteration, size and :func:`fingerprint`.
Loading it needs that base: one the model holds already (``from_pretrained``), else the one named is loaded first
(a single ``--load``, as CogVideoX's scripts do); a base whose fingerprint differs is refused.

``SAT_PATCHES_SAVE_ADAPTER_ONLY``: unset (or ``1``), adapter-only saves when the model was loaded from a
checkpoint and only LoRA matrices train, else the whole model (with ``1``, and a warning); ``0``, always whole.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Dict, Optional

from ..core import settings
from ..core.registry import SatPatchesWarning
from .files import Checkpoint, CheckpointError, find_checkpoint
from .lora_names import is_adapter
from .writer import write_text_atomic

MANIFEST = "adapter.json"
SETTING = "SAT_PATCHES_SAVE_ADAPTER_ONLY"
BASE_ATTRIBUTE = "sat_patches_base"   # set on a model by loading a whole checkpoint: its fingerprint()
_BLOCKS, _BLOCK = 16, 64 * 1024


class AdapterError(CheckpointError):
    """An adapter-only checkpoint cannot be used as asked."""


def fingerprint(ckpt: Checkpoint) -> Dict:
    """Path, iteration, total bytes and a SHA-256 of the model-states files of ``ckpt`` over their names, sizes
    and 16 blocks of 64 KiB spread over each (sampled: not a hash of the full content)."""
    digest, total = hashlib.sha256(), 0
    for file in sorted(ckpt.files):
        size = os.path.getsize(file)
        total += size
        digest.update(f"{os.path.basename(file)}:{size}".encode())
        with open(file, "rb") as f:
            for i in range(_BLOCKS):
                f.seek(max(0, size - _BLOCK) * i // (_BLOCKS - 1))
                digest.update(f.read(_BLOCK))
    return {"path": os.path.abspath(ckpt.path), "iteration": "release" if ckpt.release else ckpt.iteration,
            "bytes": total, "sha256": digest.hexdigest()}


def adapter_only(module) -> bool:
    """Whether this save of ``module`` holds its adapters only: it was loaded from a checkpoint and only
    LoRA matrices train (anything else that trains, or a model merged after training, is saved whole)."""
    try:
        chosen = settings.read(SETTING)
    except settings.SettingError as exc:
        raise AdapterError(str(exc)) from None
    if chosen is False:
        return False
    base = getattr(module, BASE_ATTRIBUTE, None)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    lora_only = bool(trainable) and all(is_adapter(n) for n in trainable)
    if chosen and (base is None or not lora_only):
        why = ("the model was not loaded from a checkpoint" if base is None
               else "parameters besides LoRA's train" if trainable else "nothing trains (LoRA merged?)")
        warnings.warn(f"{SETTING}=1 but {why}: this save holds the whole model", SatPatchesWarning, stacklevel=2)
    return base is not None and lora_only


def write_manifest(folder: str, base: Dict) -> None:
    write_text_atomic(os.path.join(folder, MANIFEST), json.dumps({"base": base}, indent=2))


def read_manifest(folder: str) -> Optional[Dict]:
    """The manifest of an iteration folder (``<run>/<N>``), None for a full save."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("base"), dict) \
            or not {"path", "iteration", "sha256"} <= set(manifest["base"]):
        raise AdapterError(f"{path} does not name a base checkpoint (path, iteration, sha256): the save is damaged")
    base = manifest["base"]["path"]
    if not isinstance(base, str) or not base:
        raise AdapterError(f"{path}: base path {base!r} is not a path: the save is damaged")
    # a relative base (an adapter moved or shared with its base beside it) is relative to this file's folder
    manifest["base"]["path"] = os.path.normpath(os.path.join(os.path.abspath(folder), base))
    return manifest


def base_checkpoint(manifest: Dict, where: str) -> Checkpoint:
    """The base checkpoint a manifest names, refused unless its files still have the manifest's fingerprint."""
    named = manifest["base"]
    base = find_checkpoint(named["path"], None if named["iteration"] == "release" else named["iteration"])
    check_base(manifest, fingerprint(base), where, "that folder now holds")
    return base


def check_base(manifest: Dict, have: Dict, where: str, holder: str = "the model holds") -> None:
    """Refuse when the base in the model (``have``: a :func:`fingerprint`) is not the adapter's."""
    want = manifest["base"]
    if have["sha256"] != want["sha256"]:
        raise AdapterError(
            f"the adapter in {where} was trained on {want['path']} iteration {want['iteration']} (sha256 "
            f"{want['sha256'][:16]}...), but {holder} {have['path']} iteration {have['iteration']} (sha256 "
            f"{have['sha256'][:16]}...): load the adapter's own base (from_pretrained, or put it back at that path "
            f"for --load) before it")

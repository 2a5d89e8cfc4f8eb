"""Every ``SAT_PATCHES_*`` environment setting, declared once: name, kind, default and meaning.

:func:`read` is the only reader of these variables in the package. Each kind has one strict parser: a value
it cannot read (a switch other than 0 or 1, a number that is not finite or not positive, a choice not on the
list) stops the run with the variable's name, the value and what to set instead. ``sat-patches doctor``
prints :data:`SETTINGS` with the values in force.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple


class SettingError(ValueError):
    """A ``SAT_PATCHES_*`` value that cannot be read; the message says what to set."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str                      # one of PARSERS
    default: Any
    meaning: str
    choices: Tuple[str, ...] = ()  # kind "choice"
    zero_turns_off: bool = False   # kind "seconds": 0 gives None

    def describe_default(self) -> str:
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return str(int(self.default))
        if isinstance(self.default, frozenset):
            return ",".join(sorted(self.default)) or "none"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


def _switch(s: Setting, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise SettingError(f"{s.name}={raw!r}: set it to 1 ({s.meaning}) or 0 (off), or unset it for the default "
                           f"({s.describe_default()})")
    return raw == "1"


def _positive(s: Setting, raw: str, unit: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if s.zero_turns_off and value == 0:
        return None
    if not (math.isfinite(value) and value > 0):
        example = s.describe_default() if s.default else "1800"
        raise SettingError(f"{s.name}={raw!r}: set it to a positive number of {unit} ({s.meaning}), e.g. "
                           f"{s.name}={example}" + (" (0 turns it off)" if s.zero_turns_off
                                                    else " (or unset it for the default)"))
    return value


def _choice(s: Setting, raw: str) -> str:
    value = raw.lower()
    if value not in s.choices:
        raise SettingError(f"{s.name}={raw!r}: set it to {' or '.join(s.choices)} ({s.meaning})")
    return value


def _fraction(s: Setting, raw: str) -> float:
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise SettingError(f"{s.name}={raw!r}: set it to a share from 0 to 1 or a percentage ({s.meaning}), e.g. "
                           f"{s.name}=0.1 or {s.name}=10% (or unset it for the default, {s.describe_default()})")
    return value


def _names(s: Setting, raw: str) -> FrozenSet[str]:
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


PARSERS = {
    "switch": _switch,
    "tristate": _switch,  # a switch whose unset state (None) lets the run decide
    "seconds": lambda s, raw: _positive(s, raw, "seconds"),
    "megabytes": lambda s, raw: _positive(s, raw, "MiB"),
    "fraction": _fraction,
    "choice": _choice,
    "names": _names,
    "text": lambda s, raw: raw,
}


SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    # patching
    Setting("SAT_PATCHES_DISABLE", "names", frozenset(), "patches to leave off, comma-separated names, or all"),
    Setting("SAT_PATCHES_FORCE", "switch", False, "apply patches where SAT's code differs from the verified one"),
    # devices and loading
    Setting("SAT_PATCHES_DEVICE", "text", None, "the device new tensors of a rank go to (tests: meta, cpu)"),
    Setting("SAT_PATCHES_SHARED_GPU", "switch", False, "several ranks share one GPU, for debugging (their CUDA "
            "collectives go through host copies over gloo)"),
    Setting("SAT_PATCHES_TRUST_CHECKPOINTS", "switch", False,
            "unpickle checkpoint files in full, for files from someone you trust"),
    Setting("SAT_PATCHES_LOAD_CHUNK_MB", "megabytes", 64.0, "the largest piece of a checkpoint tensor read at once"),
    Setting("SAT_PATCHES_LOAD_ZERO_COPY", "switch", True,
            "CPU parameters are the mapped checkpoint's pages instead of copies"),
    Setting("SAT_PATCHES_LOAD_TIMEOUT", "seconds", 1800.0, "how long ranks wait for each other while loading"),
    Setting("SAT_PATCHES_LORA_CHUNK_MB", "megabytes", 64.0, "the largest piece of a weight merged with LoRA at once"),
    Setting("SAT_PATCHES_QLORA", "switch", False, "load the language model's linears as NF4 (as --use_qlora)"),
    # training
    Setting("SAT_PATCHES_TRAINABLE", "choice", "demo", "what trains: the LoRA adapters only, or what the script "
            "trains", choices=("demo", "lora")),
    Setting("SAT_PATCHES_SAVE_ADAPTER_ONLY", "tristate", None,
            "1: saves hold the adapters only, 0: the whole model; unset: adapters when only LoRA trains on a "
            "loaded base"),
    Setting("SAT_PATCHES_BAD_RECORDS", "choice", "refuse", "what bad data records do: stop the run, or are left "
            "out", choices=("refuse", "skip")),
    Setting("SAT_PATCHES_BAD_RECORDS_MAX", "fraction", 0.1, "the largest share of bad records a run leaves out "
            "under skip"),
    Setting("SAT_PATCHES_CHECKPOINT_SELECTIVE", "fraction", 0.0, "the share of each transformer's checkpointed "
            "layers that keep their matrix products' outputs and recompute only the elementwise work"),
    Setting("SAT_PATCHES_COMPILE_LAYERS", "switch", False, "run each language layer's body as one torch.compile'd "
            "function shared by every layer"),
    Setting("SAT_PATCHES_PREPROCESS_TIMEOUT", "seconds", 7200.0,
            "how long the other ranks wait while rank 0 prepares the data sets"),
    Setting("SAT_PATCHES_COLLECTIVE_TIMEOUT", "seconds", None,
            "how long a collective may take before every rank's stack is dumped (unset: torch's 30 min)"),
    Setting("SAT_PATCHES_HEARTBEAT_TIMEOUT", "seconds", 300.0, "seconds of silence that mark a rank dead",
            zero_turns_off=True),
    # diagnostics
    Setting("SAT_PATCHES_LEDGER", "switch", True, "record the memory ledger"),
)}


def read(name: str, environ: Optional[Mapping[str, str]] = None):
    """The value of setting ``name`` (from ``environ``, default ``os.environ``): its default when unset or
    empty, else the value its kind's parser reads (:class:`SettingError` when it cannot)."""
    s = SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return s.default
    return PARSERS[s.kind](s, raw)


def table(environ: Optional[Mapping[str, str]] = None) -> List[dict]:
    """One row per setting: name, kind, default, meaning, and the value set (or the error it gives)."""
    env = os.environ if environ is None else environ
    rows = []
    for s in SETTINGS.values():
        raw = env.get(s.name, "").strip()
        try:
            read(s.name, env)
            problem = ""
        except SettingError as exc:
            problem = str(exc)
        rows.append(dict(name=s.name, kind=s.kind, default=s.describe_default(), meaning=s.meaning, value=raw,
                         problem=problem))
    return rows

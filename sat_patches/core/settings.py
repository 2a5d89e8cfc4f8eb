"""The ``SAT_PATCHES_*`` environment settings that are numbers of seconds or on/off switches, each kind
read by one parser: a value it does not take (not a number, not finite, out of range; a switch other
than 0 or 1) stops the run with a message that says what to set."""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional


def env_seconds(var: str, default: Optional[float] = None, zero_turns_off: bool = False,
                what: str = "", environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """``var`` in seconds (from ``environ``, default ``os.environ``); ``default`` when unset or empty.
    With ``zero_turns_off``, 0 gives None."""
    raw = (os.environ if environ is None else environ).get(var, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if zero_turns_off and value == 0:
        return None
    if not (math.isfinite(value) and value > 0):
        example = f"{default:.0f}" if default else "1800"
        raise ValueError(f"{var}={raw!r}: set it to a positive number of seconds{what}, e.g. {var}={example}"
                         + (" (0 turns it off)" if zero_turns_off else " (or unset it for the default)"))
    return value


def env_switch(var: str, default: bool, what: str = "", environ: Optional[Mapping[str, str]] = None) -> bool:
    """``var`` as a switch (from ``environ``, default ``os.environ``): ``1`` on, ``0`` off, ``default`` when
    unset or empty; ``what`` says what it turns on, for the message."""
    raw = (os.environ if environ is None else environ).get(var, "").strip()
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{var}={raw!r}: set it to 1 ({what or 'on'}) or 0 (off), or unset it for the default "
                         f"({int(default)})")
    return raw == "1"


def env_fraction(var: str, default: float, what: str = "", environ: Optional[Mapping[str, str]] = None) -> float:
    """``var`` as a share from 0 to 1 (from ``environ``, default ``os.environ``): ``0.1`` or ``10%``;
    ``default`` when unset or empty."""
    raw = (os.environ if environ is None else environ).get(var, "").strip()
    if not raw:
        return default
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"{var}={raw!r}: set it to a share from 0 to 1 or a percentage{what}, e.g. {var}=0.1 or "
                         f"{var}=10% (or unset it for the default, {default:g})")
    return value

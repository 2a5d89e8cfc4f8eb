"""Faults and bad input: dead ranks named, and LoRA/DeepSpeed arguments that cannot work refused.

Bad input, refused before the model is built with a message that says what to change:

* :func:`check_lora_args` -- LoRA rank <= 0, ``layer_range`` outside the model's layers, ``--use_qlora``
  without a working ``bitsandbytes``. Call it right after argument parsing (it reads ``num_layers``
  from the ``model_config.json`` of ``--from_pretrained`` when given a directory). The patch
  ``lora_args_check`` runs the same check in ``LoraMixin.__init__`` for scripts that do not call it
  (upstream's ``finetune_cogvlm_demo.py``): there it stops before any LoRA layer is allocated.
  Stock SAT takes ``r=0`` to a ``ZeroDivisionError`` (``lora_alpha / r``), a negative rank to a
  failed ``torch.empty``, and an out-of-range layer index silently adds no LoRA to it.
* ``deepspeed_config_json``: SAT's ``get_args`` ``json.load``s ``--deepspeed_config`` and a syntax
  error surfaces as a bare ``JSONDecodeError`` naming no file; now it names the file and line.

Dead ranks: a rank SIGKILLed (host OOM, as in THUDM/CogVLM#283 and THUDM/CogVLM#320) leaves the others waiting in a
collective for NCCL's/gloo's timeout (30 min by default), or failing with "Connection closed by peer"
that names nobody. The patch ``rank_heartbeat`` (on ``training_main``) runs a heartbeat thread per
rank: it bumps ``sat_patches/heartbeat/<rank>`` in the process group's store every
``timeout / 10`` s and watches every peer's counter. A peer silent for
``SAT_PATCHES_HEARTBEAT_TIMEOUT`` seconds (default 300) makes this rank print
"rank N stopped (no heartbeat for X s)", dump its stacks and exit with :data:`hangs.EXIT_CODE`
(through :func:`sat_patches.patches.hangs.fire`, which also tells the other ranks). A store that stops
answering for that long means its host (global rank 0) is gone. A rank finishing ``training_main``
marks itself done, so a normal end is not mistaken for a death. When a collective fails first
(gloo notices a closed socket), the failing rank names a peer silent for 3 beats (``timeout / 10``
each, at most 5 s) and exits; if none is silent it re-raises at once after that wait. Any other error
of the rank's own (not a lost connection) is raised at once, without that wait.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from typing import Dict, Optional, Sequence

from ..core import fenced
from ..core.coordination import PEER_LOST, error_kinds, group_store
from ..core.registry import Patch, expect_names, expect_params
from ..core.settings import env_seconds


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------
class BadInputError(ValueError):
    """An argument that cannot work; the message says what to change."""


def bitsandbytes_problem() -> Optional[str]:
    """None when ``bitsandbytes`` with ``LinearNF4`` imports, else why not."""
    try:
        from bitsandbytes.nn import LinearNF4  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (ImportError, OSError of a missing CUDA binary, ...)
        return f"{type(exc).__name__}: {exc}"
    return None


def _num_layers_of(from_pretrained: Optional[str]) -> Optional[int]:
    if from_pretrained and os.path.isdir(from_pretrained):
        from ..checkpoints.files import read_model_config
        return int(read_model_config(from_pretrained)["num_layers"])
    return None


def check_lora_args(lora_rank: Optional[int] = None, layer_range: Optional[Sequence[int]] = None,
                    num_layers: Optional[int] = None, use_qlora: bool = False,
                    from_pretrained: Optional[str] = None, what: str = "LoRA") -> None:
    """Raise :class:`BadInputError` for a LoRA set-up that cannot work."""
    if lora_rank is not None and (not isinstance(lora_rank, int) or lora_rank <= 0):
        raise BadInputError(f"{what} rank {lora_rank!r} must be a positive integer: pass e.g. --lora_rank 8")
    if num_layers is None:
        num_layers = _num_layers_of(from_pretrained)
    if layer_range is not None:
        layers = list(layer_range)
        if not layers:
            raise BadInputError(f"{what} layer_range is empty: pass layer indices, e.g. --layer_range 0 1 2, "
                                f"or leave it out for every layer")
        if num_layers is not None:
            bad = sorted({i for i in layers if not (0 <= int(i) < num_layers)})
            if bad:
                raise BadInputError(f"{what} layer_range has layer(s) {bad} outside the model's {num_layers} layers: "
                                    f"use indices 0..{num_layers - 1} (e.g. --layer_range 0 {min(15, num_layers - 1)})")
    if use_qlora:
        problem = bitsandbytes_problem()
        if problem:
            raise BadInputError(f"--use_qlora needs a working bitsandbytes (`from bitsandbytes.nn import LinearNF4` "
                                f"fails: {problem}): install it (pip install bitsandbytes) or drop --use_qlora")


def check_finetune_args(args) -> None:
    """:func:`check_lora_args` on a parsed CogVLM/CogAgent finetune namespace (``--lora_rank``,
    ``--layer_range``, ``--use_qlora``, ``--from_pretrained``); for demos to call before building."""
    if getattr(args, "use_lora", False) or getattr(args, "use_qlora", False):
        check_lora_args(getattr(args, "lora_rank", None), getattr(args, "layer_range", None),
                        use_qlora=getattr(args, "use_qlora", False),
                        from_pretrained=getattr(args, "from_pretrained", None))


def _lora_mixin_init(original):
    """LoraMixin(layer_num, r, ..., layer_range, qlora): stock SAT divides by r and skips unknown layers
    (QLoRA without bitsandbytes: THUDM/CogVLM#257, THUDM/CogVLM#438, SAT's own "Build 4bit layer failed")."""
    @functools.wraps(original)
    def __init__(self, layer_num, r=0, *args, **kwargs):
        layer_range = kwargs.get("layer_range", args[2] if len(args) > 2 else None)
        qlora = kwargs.get("qlora", args[3] if len(args) > 3 else False)
        check_lora_args(r, layer_range, num_layers=layer_num, use_qlora=qlora)
        return original(self, layer_num, r, *args, **kwargs)
    return __init__


def _deepspeed_config_path(args_list) -> Optional[str]:
    argv = list(sys.argv[1:] if args_list is None else args_list)
    for i, a in enumerate(argv):
        for flag in ("--deepspeed_config", "--deepspeed-config"):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def _get_args(original):
    """SAT's get_args json.loads --deepspeed_config: a syntax error names neither file nor fix."""
    @functools.wraps(original)
    def get_args(args_list=None, parser=None):
        try:
            return original(args_list, parser)
        except json.JSONDecodeError as exc:
            from .deepspeed_setup import DeepSpeedConfigError
            path = _deepspeed_config_path(args_list) or "--deepspeed_config"
            raise DeepSpeedConfigError(
                f"DeepSpeed config '{path}' is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}: "
                f"fix that line (JSON has no comments, no trailing commas, and needs double quotes)") from exc
    return get_args


# --------------------------------------------------------------------------------------
# Heartbeats
# --------------------------------------------------------------------------------------
HEARTBEAT_ENV = "SAT_PATCHES_HEARTBEAT_TIMEOUT"
PREFIX = "sat_patches/heartbeat/"


def heartbeat_timeout() -> Optional[float]:
    """Seconds of silence after which a peer is declared dead; None (off) when set to 0."""
    try:
        return env_seconds(HEARTBEAT_ENV, 300.0, zero_turns_off=True, what=" of silence that mark a rank dead")
    except ValueError as exc:
        raise BadInputError(str(exc)) from None


class Heartbeat:
    """This rank's beat and its view of every peer's."""

    def __init__(self, store, rank: int, world: int, timeout: float):
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.interval = max(0.05, min(5.0, timeout / 10))
        self.seen: Dict[int, tuple] = {}      # peer -> (counter, monotonic time it last changed)
        self.store_ok = time.monotonic()
        self.reason: Optional[str] = None     # the first dead peer found (by either thread), kept
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sat_patches-heartbeat", daemon=True)

    def beat(self) -> None:
        self.store.add(f"{PREFIX}{self.rank}", 1)

    def done(self) -> None:
        self.stop.set()
        try:
            self.store.set(f"{PREFIX}{self.rank}/done", "1")
        except Exception:  # noqa: BLE001
            pass

    def dead(self, silence: Optional[float] = None) -> Optional[str]:
        """Why a peer counts as dead (silent for ``silence`` s, default the timeout), or None. The first
        answer is kept: once the store's host has exited too, the store cannot tell any more."""
        if self.reason is None:
            self.reason = self._dead(self.timeout if silence is None else silence)
        return self.reason

    def _dead(self, silence: float) -> Optional[str]:
        now = time.monotonic()
        try:
            for peer in range(self.world):
                if peer == self.rank:
                    continue
                if self.store.check([f"{PREFIX}{peer}/done"]):
                    continue
                count = self.store.add(f"{PREFIX}{peer}", 0)
                if count == 0:
                    continue  # not started yet (still preprocessing/loading): hangs.py's timeouts cover it
                last = self.seen.get(peer)
                if last is None or last[0] != count:
                    self.seen[peer] = (count, now)
                elif now - last[1] > silence:
                    return f"rank {peer} stopped (no heartbeat for {now - last[1]:.0f} s; {HEARTBEAT_ENV}={self.timeout:g})"
            self.store_ok = now
        except Exception as exc:  # noqa: BLE001  (the store's host is gone)
            if now - self.store_ok > silence:
                return (f"rank 0 stopped (no heartbeat for {now - self.store_ok:.0f} s: the store it hosts is "
                        f"unreachable, {type(exc).__name__}; {HEARTBEAT_ENV}={self.timeout:g})")
        return None

    def _run(self) -> None:
        while not self.stop.wait(self.interval) and not fenced.HEARTBEAT.off:
            try:
                self.beat()
            except Exception:  # noqa: BLE001
                pass
            reason = fenced.HEARTBEAT.run(self.dead)
            if reason and not self.stop.is_set():
                self.fire(reason)

    def fire(self, reason: str) -> None:
        """End the run on this rank for ``reason`` (a dead peer) through :func:`hangs.fire`: stacks
        dumped, the other ranks told, exit status :data:`hangs.EXIT_CODE`."""
        from . import hangs
        hangs.fire(reason, threading.main_thread().ident, leader=True, in_collective=hangs.in_collective())

    def wait_for_dead(self) -> Optional[str]:
        """After a failed collective (gloo saw a peer's socket close): a peer silent for 3 beats is
        dead; wait at most that long (+ one beat) to name it."""
        silence = min(self.timeout, 3 * self.interval)
        deadline = time.monotonic() + silence + 2 * self.interval
        while time.monotonic() < deadline:
            reason = self.dead(silence)
            if reason:
                return reason
            time.sleep(self.interval)
        return None


_heartbeat: Optional[Heartbeat] = None


def start_heartbeat(timeout: Optional[float] = None) -> Optional[Heartbeat]:
    global _heartbeat
    import torch.distributed as dist
    timeout = heartbeat_timeout() if timeout is None else timeout
    if _heartbeat is not None or timeout is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return _heartbeat
    _heartbeat = Heartbeat(group_store(), dist.get_rank(), dist.get_world_size(), timeout)
    _heartbeat.beat()
    _heartbeat.thread.start()
    return _heartbeat


def _lost_peer(exc: BaseException) -> bool:
    """A failure that a dead peer can cause (gloo's closed socket, c10d's DistError, NCCL): worth waiting
    a few beats to name the dead rank. A plain error of this rank's own is raised at once."""
    return PEER_LOST in error_kinds(exc)


def _training_main(original):
    """SAT's training_main: a SIGKILLed rank leaves the others in a collective for 30 min, unnamed
    (THUDM/CogVLM#283, THUDM/CogVLM#320: kill -9, "training stops with no clear error")."""
    @functools.wraps(original)
    def training_main(args, *a, **kw):
        heartbeat_timeout()  # a bad setting is the user's to fix: refused, not fenced
        hb = fenced.HEARTBEAT.run(start_heartbeat)
        try:
            result = original(args, *a, **kw)
        except Exception as exc:
            if hb is not None and _lost_peer(exc):
                reason = hb.wait_for_dead()
                if reason:
                    hb.fire(reason)
            raise
        if hb is not None:
            hb.done()
        return result
    return training_main


PATCHES = [
    Patch("lora_args_check", "sat.model.finetune.lora2:LoraMixin.__init__", _lora_mixin_init,
          answers="stock SAT divides by a LoRA rank of 0 and skips layers outside the model; THUDM/CogVLM#257, #438 "
                  "(QLoRA without bitsandbytes): LoRA rank <= 0, "
                  "layer_range outside the model, --use_qlora without bitsandbytes refused before LoRA layers are built",
          expect=expect_params("layer_num", "r", "layer_range", "qlora")),
    Patch("deepspeed_config_json", "sat.arguments:get_args", _get_args,
          answers="stock SAT: a --deepspeed_config that is not valid JSON fails with a bare JSONDecodeError; now "
                  "the message names the file and line",
          expect=expect_names("json", "load", "deepspeed_config")),
    Patch("rank_heartbeat", "sat.training.deepspeed_training:training_main", _training_main,
          answers="THUDM/CogVLM#283, #320 (kill -9; 'training stops with no clear error'): survivors of a "
                  "dead rank exit non-zero within SAT_PATCHES_HEARTBEAT_TIMEOUT naming it",
          expect=expect_names("train")),
]

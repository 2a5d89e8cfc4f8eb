"""What every part of the GPU proof kit shares: the rows it records, its device, the modules SAT imports
but the proof never uses.

A row is one check: ``ok``, ``FAIL`` (with the error) or ``skipped: <why>``, a measured figure beside
what was expected of it (the plan's, or the value it must equal), and its seconds. A part writes its
rows to its JSON file as each one ends, so a part stopped at its time limit keeps what it had done.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import List, Optional

NO_CUDA = "skipped: no CUDA"
# Imported but never called by the proof: wandb and datasets by SAT 0.4.12 at `import sat` (`--wandb` is off, no
# Hugging Face data set is read), spacy by a CogVLM checkout's `utils/utils/grounding_parser.py` (the fine-tune
# parses no grounding answer); not carried to the GPU machine (wandb's wheel alone is 20 MB, spacy's 35 MB, of
# the 64 MiB carry).
UNUSED_BY_THE_PROOF = ("wandb", "datasets", "spacy")


@dataclass
class Row:
    part: str
    check: str
    status: str = "ok"
    measured: str = ""
    expected: str = ""
    seconds: float = 0.0
    detail: str = ""


class Skip(Exception):
    """Raised inside :meth:`Recorder.check` to record the check as skipped, with the reason."""


@dataclass
class Recorder:
    part: str
    path: Optional[str] = None          # the part's JSON file, rewritten after every row
    rows: List[Row] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # more keys of the part's JSON (the machine it ran on)

    @contextlib.contextmanager
    def check(self, name: str, expected: str = ""):
        """``with rec.check(name) as row:`` set ``row.measured`` (and ``row.detail``); an exception marks
        the row FAIL with its message, :class:`Skip` marks it skipped, an AssertionError's text is kept."""
        row, start = Row(self.part, name, expected=expected), time.perf_counter()
        try:
            yield row
        except Skip as why:
            row.status = f"skipped: {why}"
        except Exception as exc:  # noqa: BLE001 (one failing check must not hide the others)
            _fail(row, exc)
        finally:
            row.seconds = round(time.perf_counter() - start, 3)
            self.add(row)

    def guarded(self, func, *args) -> None:
        """``func(self, *args)``; an exception it lets out (outside its own checks) becomes a FAIL row."""
        try:
            func(self, *args)
        except Exception as exc:  # noqa: BLE001
            row = Row(self.part, f"({func.__name__})")
            _fail(row, exc)
            self.add(row)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.save()
        print(f"[{self.part}] {row.check}: {row.status} {row.measured} {row.detail}".rstrip(), flush=True)

    def save(self) -> None:
        if self.path:
            data = {"part": self.part, "rows": [asdict(r) for r in self.rows], "imports": imported_distributions(),
                    "stood_in": stood_in(), **self.extra}
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)


def _fail(row: Row, exc: BaseException) -> None:
    row.status = "FAIL"
    row.detail = (f"{row.detail}; " if row.detail else "") + f"{type(exc).__name__}: {exc}"[:600]
    row.detail += " @ " + " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}"
                                      for f in reversed(traceback.extract_tb(exc.__traceback__)[-3:]))


def cuda() -> bool:
    """Whether the proof runs on CUDA (not with ``--tiny``, which sets ``SAT_PATCHES_DEVICE=cpu``)."""
    import torch
    return os.environ.get("SAT_PATCHES_DEVICE", "") != "cpu" and torch.cuda.is_available()


def require_cuda() -> None:
    if not cuda():
        raise Skip("no CUDA")


def device():
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if cuda() else torch.device("cpu")


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


# Called at import by a module the proof imports: the checkout's grounding parser loads spacy's English model at import
# (the user's `python -m spacy download en_core_web_sm`); what the call returns raises when it is used.
CALLED_AT_IMPORT = {"spacy": ("load",)}
PLACEHOLDER = '''"""sat_patches GPU proof: {name} is not installed here (not used by the proof)."""
__sat_patches_placeholder__ = True
CALLED_AT_IMPORT = {called!r}


class Unused:
    def __init__(self, what):
        self.what = what

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{{self.what}}: {name} is not installed on this machine (the GPU proof does not use it)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unused(f"{{self.what}}.{{attr}}")


def __getattr__(attr):
    if attr.startswith("__"):  # what importers and inspect probe (__file__, __path__, ...)
        raise AttributeError(f"placeholder module {name!r} has no attribute {{attr!r}}")
    if attr in CALLED_AT_IMPORT:
        return lambda *args, **kwargs: Unused(f"{name}.{{attr}}(...)")
    return Unused(f"{name}.{{attr}}")
'''


def stand_in_unused(folder: str) -> List[str]:
    """Write a placeholder module into ``folder`` for each of :data:`UNUSED_BY_THE_PROOF` that does not import
    here (every attribute, when called, says it was not carried) and put ``folder`` first on ``sys.path`` and on
    ``PYTHONPATH``: the processes a part launches (the demo's ranks) import SAT too. Returns the names imported so
    far as placeholders (each run's JSON lists those its part imported under ``stood_in``)."""
    os.makedirs(folder, exist_ok=True)
    for name in UNUSED_BY_THE_PROOF:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (absent, or broken against this machine's other packages)
            sys.modules.pop(name, None)
            with open(os.path.join(folder, f"{name}.py"), "w", encoding="utf-8") as f:
                f.write(PLACEHOLDER.format(name=name, called=CALLED_AT_IMPORT.get(name, ())))
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    return stood_in()


def stood_in() -> List[str]:
    return sorted(n for n, m in list(sys.modules.items()) if getattr(m, "__dict__", {}).get("__sat_patches_placeholder__", False))


@functools.lru_cache(maxsize=1)
def _owners() -> dict:
    import importlib.metadata as metadata
    return metadata.packages_distributions()


def imported_distributions() -> List[str]:
    """The installed distributions whose top-level modules this process has imported (what the GPU machine
    must have, or have carried to it)."""
    owners = _owners()
    names = set()
    for module in list(sys.modules):
        for dist in owners.get(module.partition(".")[0], []):
            names.add(dist)
    return sorted(names)

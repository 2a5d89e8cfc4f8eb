"""Third-party messages that say nothing about a sat_patches run, filtered out at ``import sat_patches``:
bitsandbytes' optional CPU kernel download, DeepSpeed's "Setting accelerator to CPU" (sat_patches names the
ranks' device once), torch's DataLoader 'pin_memory' warning without an accelerator.
``SAT_PATCHES_DISABLE=quiet_third_party`` keeps them.
"""
from __future__ import annotations

import logging
import re
import warnings

PATCH_NAME = "quiet_third_party"
QUIETED = {  # logger -> the start of the message dropped from it
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "DeepSpeed": "Setting accelerator to CPU",
}


class DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.text)


FILTERS = {name: DropMessage(text) for name, text in QUIETED.items()}
QUIETED_WARNINGS = ("'pin_memory' argument is set as true but no accelerator is found",)


def _warning_filters():
    return [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None
            and any(f[1].pattern == re.escape(text) for text in QUIETED_WARNINGS)]


def install() -> None:
    for name, f in FILTERS.items():
        logging.getLogger(name).addFilter(f)  # (a filter already there is not added twice)
    if not _warning_filters():
        for text in QUIETED_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning)


def remove() -> None:
    for name, f in FILTERS.items():
        logging.getLogger(name).removeFilter(f)
    for f in _warning_filters():
        warnings.filters.remove(f)
    getattr(warnings, "_filters_mutated", lambda: None)()  # warnings seen before may show again


def is_installed() -> bool:
    return all(f in logging.getLogger(name).filters for name, f in FILTERS.items()) and bool(_warning_filters())

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


def installed(logger_name: str) -> bool:
    return any(isinstance(f, DropMessage) for f in logging.getLogger(logger_name).filters)


QUIETED_WARNINGS = ("'pin_memory' argument is set as true but no accelerator is found",)


def _warning_filters():
    return [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None
            and any(f[1].pattern == re.escape(text) for text in QUIETED_WARNINGS)]


def install() -> None:
    for name, text in QUIETED.items():
        if not installed(name):
            logging.getLogger(name).addFilter(DropMessage(text))
    if not _warning_filters():
        for text in QUIETED_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning)


def remove() -> None:
    for name in QUIETED:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, DropMessage)]:
            logger.removeFilter(f)
    for f in _warning_filters():
        warnings.filters.remove(f)
    getattr(warnings, "_filters_mutated", lambda: None)()  # warnings seen before may show again


def is_installed() -> bool:
    return all(installed(name) for name in QUIETED) and bool(_warning_filters())

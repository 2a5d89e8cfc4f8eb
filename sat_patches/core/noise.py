"""Third-party messages that say nothing about a sat_patches run, filtered out of their loggers.

Every process of a run (each rank, the demo's prepare/merge/verify steps) logged them at import:

* bitsandbytes' CPU backend: "Failed to load CPU gemm_4bit_forward from kernels-community ...": an
  optional faster CPU kernel for 4-bit matmuls (QLoRA on CPU), fetched from a model hub.
* DeepSpeed: "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
  detect it.": the ranks' device is what matters, and sat_patches says it once, on rank 0, when the
  ranks have agreed on it (:func:`sat_patches.runtime.distributed.check_ranks_agree_on_device`).
* torch's DataLoader, per loader: "'pin_memory' argument is set as true but no accelerator is
  found": SAT asks for pinned memory, which only applies where there is an accelerator; the warning
  is raised only where there is none.

The filters go on at ``import sat_patches``, before SAT (and with it bitsandbytes and DeepSpeed) is
imported; ``SAT_PATCHES_DISABLE=quiet_third_party`` keeps the messages.
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

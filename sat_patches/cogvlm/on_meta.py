"""CogVLM/CogAgent built at full size on meta (no memory, seconds on a CPU): what a rank of a
model-parallel run holds, from the project's checkpoint-compatible classes."""
from __future__ import annotations

import contextlib
import copy
import sys
from typing import Dict, Iterator, Tuple
from unittest import mock

import sat.mpu.initialize as initialize
import torch

from ..runtime import construction
from . import config as cogvlm_config
from .models import model_class_for


@contextlib.contextmanager
def stood_in(stand_ins: Dict[str, Tuple[object, object]]) -> Iterator[None]:
    """``{name: (original, stand_in)}``: every loaded module whose ``name`` is ``original`` reads ``stand_in``."""
    with contextlib.ExitStack() as stack:
        for module in list(sys.modules.values()):
            for name, (original, stand_in) in stand_ins.items():
                if getattr(module, name, None) is original:
                    stack.enter_context(mock.patch.object(module, name, stand_in))
        yield


def model_parallel_as(size: int, rank: int = 0):
    """SAT's model-parallel world size and rank read as ``size`` and ``rank`` by every loaded
    module, without a process group (layers size their shards from these)."""
    return stood_in({"get_model_parallel_world_size": (initialize.get_model_parallel_world_size, lambda: size),
                      "get_model_parallel_rank": (initialize.get_model_parallel_rank, lambda: rank)})


def build_on_meta(config: dict, mp: int = 1):
    """The model of ``config`` (a ``model_config.json`` dict of CogVLM or CogAgent) as model-parallel
    rank 0 of ``mp`` holds it, on meta, in bf16."""
    cls = model_class_for(config["model_class"], finetune=False)
    args = cls.get_args()
    for key, value in {**cogvlm_config._run_defaults(), **copy.deepcopy(config)}.items():
        setattr(args, key, value)
    args.model_parallel_size, args.skip_init = mp, True
    with model_parallel_as(mp), construction.build_on("meta", torch.bfloat16):
        return cls(args)

"""Checkpoints load rank-locally from memory-mapped files at any model-parallel size
(:mod:`sat_patches.checkpoints.loading`), and one run's ranks share its ``experiment_name``.
"""
from __future__ import annotations

import datetime
import functools

from ..checkpoints.loading import (SharedStartClock, from_pretrained_unless_zero3, load_checkpoint_unless_zero3,
                                   training_main_with_shared_start,)
from ..core.coordination import check_local_world_size
from ..core.registry import Patch, delegate, expect_names, expect_params


def _from_pretrained(auto: bool):
    """SAT's from_pretrained, rank-local at any MP size; under ZeRO-3 SAT's own (zero.Init places weights)."""
    def make(original):
        @functools.wraps(original.__func__)
        def wrapper(cls, name, args=None, **kwargs):
            return from_pretrained_unless_zero3(original.__func__, auto, cls, name, args, **kwargs)
        return classmethod(wrapper)
    return make


def _initialize_model_parallel(original):
    @functools.wraps(original)
    def initialize_model_parallel(model_parallel_size_):
        check_local_world_size()
        return original(model_parallel_size_)
    return initialize_model_parallel


def _expect_datetime_class(original):
    return None if original is datetime.datetime else f"it is {original!r}, not the datetime class"


def _expect_from_pretrained(original):
    return expect_names("mp_split_model_rank0", "from_pretrained_base")(original) or \
        expect_params("overwrite_args", "use_node_group")(original)


PATCHES = [
    Patch("load_checkpoint_mmap", "sat.training.model_io:load_checkpoint", delegate(load_checkpoint_unless_zero3),
          answers="THUDM/CogVLM#283, #320, #162: every rank torch.loads the whole checkpoint into RAM (no mmap); "
                  "MP=N checkpoints load only at MP=N",
          expect=expect_names("get_checkpoint_name", "load_state_dict", "reinit")),
    Patch("from_pretrained_rank_local", "sat.model.base_model:BaseModel.from_pretrained", _from_pretrained(False),
          answers="THUDM/SwissArmyTransformer#173, THUDM/CogVLM#162, #233: MP>1 from_pretrained builds the full "
                  "model on node rank 0 and sends partitions (.cuda()); MP=N to MP=N raises "
                  "'model_parallel_size is inconsistent'; mutates the caller's args",
          expect=_expect_from_pretrained),
    Patch("automodel_from_pretrained_rank_local", "sat.model.base_model:AutoModel.from_pretrained",
          _from_pretrained(True),
          answers="THUDM/SwissArmyTransformer#173, THUDM/CogVLM#233: AutoModel.from_pretrained, same "
                  "model-parallel path as BaseModel's",
          expect=_expect_from_pretrained),
    Patch("local_world_size_check", "sat.mpu.initialize:initialize_model_parallel", _initialize_model_parallel,
          answers="THUDM/SwissArmyTransformer#173, CogVLM's finetune_demo: LOCAL_WORLD_SIZE=8 from .deepspeed_env "
                  "on a 2-GPU box leaves SAT's node groups empty ('node group is not initialized')",
          expect=expect_names("environ", "_NODE_GROUP", "new_group")),
    Patch("shared_experiment_start", "sat.training.deepspeed_training:datetime", SharedStartClock,
          answers="THUDM/CogVLM#269: SAT's training module reads the clock of each rank for experiment_name; "
                  "it gets a clock whose first now() in training_main is rank 0's start time",
          expect=_expect_datetime_class),
    Patch("shared_experiment_name", "sat.training.deepspeed_training:training_main",
          delegate(training_main_with_shared_start),
          answers="THUDM/CogVLM#269: experiment_name timestamps differ per rank, one MP run saves into two "
                  "directories; rank 0's start time is shared (with shared_experiment_start)",
          expect=expect_names("experiment_name", "datetime", "strftime")),
]

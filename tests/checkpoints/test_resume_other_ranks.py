"""A run resumed with another number of data-parallel ranks, its global batch kept (another layout of nodes): the
data position counts whole iterations of micro-batches, and the ZeRO optimizer shards are merged and split again
(elastic), or refused with what to do (rigid)."""
import pytest
import torch

from sat_patches.checkpoints import resume
from sat_patches.checkpoints.files import CheckpointError


def test_one_rank_skips_every_micro_batch_of_the_iterations_it_resumes_after():
    loader = torch.utils.data.DataLoader(list(range(40)), batch_size=4)
    resumed = resume.resumable(loader, accumulation=2)
    resumed.batch_sampler.start_iter = 2  # SAT's --resume-dataloader after 2 iterations of 2 micro-batches of 4
    assert next(iter(resumed)).tolist() == [16, 17, 18, 19]
    assert next(iter(resumed)).tolist() == [0, 1, 2, 3]  # once


class Engine:
    """What ``_load_zero_shards`` reads of DeepSpeed's engine: saved at 2 data-parallel ranks, running at 1."""

    def __init__(self, shards, elastic, saved_by=2):
        self.loaded_checkpoint_dp_world_size, self.seq_dp_world_size, self.shards = saved_by, 1, shards
        self.optimizer = type("Optimizer", (), {"elastic_checkpoint": elastic, "load_state_dict": self.load})()
        self.loaded = None

    def _get_all_zero_checkpoints(self, load_dir, tag):
        return self.shards

    def zero_load_from_fp32_weights(self):
        return True

    def _get_zero_param_shapes(self):
        return []

    def load(self, state_dict_list, **kw):
        self.loaded = (state_dict_list, kw)


def _args():
    return type("Args", (), {"load": "/runs/finetune", "iteration": 4})()


def test_elastic_shards_saved_by_other_ranks_are_split_again_with_torchs_adam_step():
    shards = [{"base_optimizer_state": [{"step": torch.tensor(4.0), "exp_avg": torch.zeros(3)}]} for _ in range(2)]
    engine = Engine(shards, elastic=True)
    assert resume._load_zero_shards(engine, _args())
    loaded, kw = engine.loaded
    assert [s["base_optimizer_state_step"] for s in loaded] == [4, 4]  # where DeepSpeed's elastic restore reads it
    assert kw["load_optimizer_states"] and kw["load_from_fp32_weights"]


def test_elastic_shards_saved_by_as_many_ranks_get_torchs_adam_step_too():
    """DeepSpeed's own load of elastic shards asserts a step that torch's Adam keeps elsewhere."""
    shards = [{"base_optimizer_state": [{"step": torch.tensor(2.0), "exp_avg": torch.zeros(3)}]}]
    engine = Engine(shards, elastic=True, saved_by=1)
    assert resume._load_zero_shards(engine, _args())
    assert [s["base_optimizer_state_step"] for s in engine.loaded[0]] == [2]


def test_rigid_shards_saved_by_other_ranks_are_refused_with_what_to_do():
    shards = [{"base_optimizer_state": {"state": {}, "param_groups": []}} for _ in range(2)]
    with pytest.raises(CheckpointError, match=r"saved by 2 data-parallel rank\(s\) and this run has 1: .* resume "
                                              r"with 2 data-parallel ranks"):
        resume._load_zero_shards(Engine(shards, elastic=True), _args())

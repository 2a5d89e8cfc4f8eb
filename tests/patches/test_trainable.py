"""SAT_PATCHES_TRAINABLE=lora trains the adapters only; demo keeps what the script trains."""
import pytest
import torch

import sat_patches
from sat_patches.core.kinds import KINDS
from sat_patches.runtime import trainable


class TinyLoraModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(4, 4)
        self.matrix_A = torch.nn.Parameter(torch.zeros(2, 4))
        self.matrix_B = torch.nn.Parameter(torch.zeros(4, 2))

    def disable_untrainable_params(self):  # a demo script's own choice: everything but the bias
        self.dense.bias.requires_grad_(False)


def _sat_setup_stand_in(args, model, config_params=None):
    """What SAT's setup does first: ask the model which parameters train."""
    model.disable_untrainable_params()
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("value, trains", [("lora", {"matrix_A", "matrix_B"}),
                                           ("demo", {"matrix_A", "matrix_B", "dense.weight"}),
                                           ("", {"matrix_A", "matrix_B", "dense.weight"})])
def test_setting_decides_what_trains(monkeypatch, value, trains):
    monkeypatch.setenv(trainable.ENV, value)
    assert trainable.setup_with_trainable_setting(_sat_setup_stand_in, None, TinyLoraModel()) == trains


def test_bad_setting_and_lora_without_adapters_are_refused(monkeypatch):
    monkeypatch.setenv(trainable.ENV, "all")
    with pytest.raises(ValueError, match="set it to demo or lora"):
        trainable.setting()
    with pytest.raises(ValueError, match="no LoRA parameters"):
        trainable.adapters_only(torch.nn.Linear(2, 2))


def test_patch_is_on_sats_setup():
    from sat.training import deepspeed_training
    assert sat_patches.is_patched("trainable_setting")
    assert sat_patches.core.registry.REGISTRY.get("trainable_setting").is_applied()
    assert deepspeed_training.setup_model_untrainable_params_and_optimizer.__sat_patches__ is not None


def test_standalone_demo_rule_is_upstreams():
    cogvlm = KINDS["cogvlm"].demo_trains
    mlp = "mixins.eva.vit_model.transformer.layers.{}.mlp.dense_h_to_4h.weight"
    assert [cogvlm(mlp.format(i)) for i in (45, 46, 54, 55)] == [False, True, True, False]
    assert not cogvlm("transformer.layers.50.mlp.dense_h_to_4h.weight")  # the language model's MLP stays frozen
    cogagent = KINDS["cogagent"].demo_trains
    assert cogagent("mixins.encoder.transformer.layers.0.attention.dense.weight")
    assert not cogagent("transformer.layers.3.mlp.dense_h_to_4h.weight")  # the language MLP stays frozen
    assert cogagent("mixins.mlp.vision_dense_h_to_4h_list.3.weight")

"""One table of model kinds: the trainer and the memory plan read one "what upstream's demo trains" rule."""
import dataclasses

import pytest

from sat_patches.core.kinds import EVA_MLP_NAME, KINDS, kind


def test_cogvlm_demo_trains_the_mlp_of_eva_layers_46_to_54_and_the_plan_counts_the_same():
    trains = KINDS["cogvlm"].demo_trains
    assert [i for i in range(63) if trains(EVA_MLP_NAME.format(i=i))] == list(range(46, 55))
    assert not trains("mixins.eva.vit_model.transformer.layers.50.attention.query_key_value.weight")
    assert KINDS["cogvlm"].demo_eva_mlp_layers(63) == 9 and KINDS["cogvlm"].demo_eva_mlp_layers(50) == 4
    assert KINDS["cogagent"].demo_eva_mlp_layers(63) == 63                 # its demo trains the whole tower


def test_the_plan_reads_the_kinds_rule(monkeypatch):
    from sat_patches.cogvlm.shapes import upstream_config
    from sat_patches.planning import shapes
    config = upstream_config("cogvlm-base-490")
    before = sum(p.total for p in shapes.demo_trainable_parts(config))
    monkeypatch.setitem(KINDS, "cogvlm", dataclasses.replace(KINDS["cogvlm"], demo_trains=lambda name: False))
    assert before > 0
    assert sum(p.total for p in shapes.demo_trainable_parts(config)) == 0


def test_an_unknown_kind_names_the_kinds():
    with pytest.raises(ValueError, match="model kind must be one of cogvlm, cogagent, not 'cogvlm2'"):
        kind("cogvlm2")

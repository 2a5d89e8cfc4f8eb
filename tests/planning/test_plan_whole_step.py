"""The plan's activation terms against a whole training step of the released model at full size, on meta
(``benchmarks/calibration/layer_bytes.py.step_peak``): every layer, activation checkpointing on as the scripts
set it, for the scripts' ``TRAINABLE=lora`` (``benchmarks/plan_calibration.py`` prints ``demo`` too; its
layers are tested one by one in ``test_plan_calibration.py``)."""
import pytest

from sat_patches.cogvlm.shapes import upstream_config
from sat_patches.core.kinds import KINDS
from layer_bytes import planned_activations, released_layers, step_peak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("selective", [0.0, 0.5], ids=["full", "half-selective"])
@pytest.mark.parametrize("name, kind", [("cogvlm-base-490", "cogvlm"), ("cogagent-chat", "cogagent")])
def test_the_plans_activations_cover_a_whole_step_by_at_most_30_percent(name, kind, selective, train="lora"):
    """The plan adds its terms' peaks, which come at different moments of the step: it may plan more than the
    step's peak, never less; with every layer checkpointed, and with half of them selectively."""
    config = upstream_config(name)
    layers = released_layers(config)
    trains = KINDS[kind].demo_trains if train == "demo" else (lambda n: False)
    measured = step_peak(config, 1, layers=layers, checkpoint=True, trains=trains, selective=selective)
    planned = sum(planned_activations(config, 1, layers=layers, checkpoint=True, train=train,
                                      selective=selective).values())
    assert measured <= planned <= 1.3 * measured, (planned, measured)

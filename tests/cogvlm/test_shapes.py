"""The plan's parameters per rank are the model's: CogVLM and CogAgent built at full size on meta
(the project's checkpoint-compatible classes) at model-parallel sizes 1, 2 and 4."""
import pytest

from sat_patches.cogvlm.shapes import RELEASED, upstream_config
from sat_patches.cogvlm.on_meta import build_on_meta
from sat_patches.planning import shapes


def model_config(name: str) -> dict:
    return upstream_config(name)


# released names with the same shapes (chat, grounding: the base model's) are built once
SHAPES = {shape: sorted(n for n, s in RELEASED.items() if s == shape) for shape in sorted(set(RELEASED.values()))}


def test_the_plan_reads_the_models_table():
    """One table of shapes: every released name is a plan entry, read from the models' own table."""
    assert sorted(shapes.MODELS) == sorted(RELEASED)
    for name in RELEASED:
        assert {k: v for k, v in shapes.MODELS[name].items() if k in upstream_config(name)} == upstream_config(name)


@pytest.mark.parametrize("mp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plan_parameters_per_rank_equal_the_meta_built_model(name, mp):
    model = build_on_meta(model_config(name), mp)
    built = sum(p.numel() for p in model.parameters())
    for entry in SHAPES[name]:
        planned = sum(p.per_rank(mp) for p in shapes.model_parts(shapes.MODELS[entry]) if not p.buffer)
        assert planned == built, (entry, mp, planned, built)

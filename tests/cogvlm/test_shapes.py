"""The plan's parameters per rank are the model's: CogVLM and CogAgent built at full size on meta
(the project's checkpoint-compatible classes) at model-parallel sizes 1, 2 and 4."""
import copy

import pytest

from sat_patches.cogvlm.config import UPSTREAM_CONFIGS
from sat_patches.testing.full_size import build_on_meta
from sat_patches.tools import plan


def model_config(name: str) -> dict:
    """The released model_config.json of the family, at the plan entry's image size."""
    planned = plan.MODELS[name]
    config = copy.deepcopy(UPSTREAM_CONFIGS["cogagent-chat" if planned.get("cross_image_pix") else "cogvlm-base-490"])
    config["image_length"] = planned["image_length"]
    config["eva_args"].update(image_size=planned["eva_args"]["image_size"],
                              max_sequence_length=planned["eva_args"]["max_sequence_length"])
    return config


# plan entries with the same shapes (chat, grounding: the base model's) are built once
SHAPES = {"cogvlm-base-224": ["cogvlm-base-224"],
          "cogvlm-base-490": ["cogvlm-base-490", "cogvlm-chat-v1.1", "cogvlm-grounding-generalist"],
          "cogagent-chat": ["cogagent-chat", "cogagent-vqa"]}


def test_every_plan_entry_is_covered():
    assert sorted(n for names in SHAPES.values() for n in names) == sorted(plan.MODELS)


@pytest.mark.parametrize("mp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plan_parameters_per_rank_equal_the_meta_built_model(name, mp):
    model = build_on_meta(model_config(name), mp)
    built = sum(p.numel() for p in model.parameters())
    for entry in SHAPES[name]:
        planned = sum(p.per_rank(mp) for p in plan.model_parts(plan.MODELS[entry]) if not p.buffer)
        assert planned == built, (entry, mp, planned, built)

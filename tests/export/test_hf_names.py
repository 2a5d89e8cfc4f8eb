"""The exported names and shapes of both released models at full size (built on meta) equal fixtures written
by hand from the released Hugging Face code and config.json (tests/fixtures/*.hf-keys.json), as
tests/fixtures/*.keys.json do for SAT's names."""
import json
import os
import re

import pytest

from sat_patches.cogvlm.shapes import upstream_config
from sat_patches.export import names
from sat_patches.cogvlm.on_meta import build_on_meta

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
RELEASED = {"cogvlm-base-490": "cogvlm-base-490-hf", "cogagent-chat": "cogagent-chat-hf"}


def load(name):
    with open(os.path.join(FIXTURES, f"{name}.hf-keys.json")) as f:
        return json.load(f)


def namespace(config):
    out = {k: v for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out.update({"v_" + k: v for k, v in config["vision_config"].items() if isinstance(v, (int, float))})
    return out


def evaluate(expr, values):
    return eval(expr, {"__builtins__": {}}, values)  # noqa: S307 (fixture text)


def normalise(key):
    return re.sub(r"\.\d+(?=\.|$)", ".N", key)


@pytest.mark.parametrize("sat_name", sorted(RELEASED))
def test_full_size_export_names_and_shapes_equal_released_layout(sat_name):
    fixture = load(RELEASED[sat_name])
    config = upstream_config(sat_name)
    model = build_on_meta(config)
    state = model.state_dict()
    exported = {hf: tuple(state[sat].shape) for hf, sat in names.hf_items(state, config["num_layers"])}
    assert len(exported) == sum(len(names.hf_names(k, config["num_layers"])) for k in state)  # one name each
    assert {normalise(k) for k in exported} == set(fixture["keys"])

    hf_config = names.hf_config(config, "bfloat16")
    for field, value in fixture["config"].items():   # the released config.json's values, from our config
        assert hf_config[field] == value, field
    values = namespace(hf_config)
    for key, shape in exported.items():
        assert shape == tuple(evaluate(e, values) for e in fixture["keys"][normalise(key)]), key
    for prefix, count in fixture["layer_counts"].items():
        indices = {int(k[len(prefix) + 1:].split(".")[0]) for k in exported if k.startswith(prefix + ".")}
        assert indices == set(range(evaluate(count, values))), prefix

    # and back: every HF name gives its SAT key, the SAT config round-trips through config.json
    assert {names.sat_name(k) for k in exported} == set(state)
    back = names.sat_config(hf_config, 1)
    for key in ("model_class", "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "inner_hidden_size",
                "image_length", "eva_args", "cross_attn_hidden_size", "cross_hidden_size_per_attention_head",
                "cross_image_pix", "is_decoder", "text_processor_version"):
        assert back.get(key) == config.get(key), key


def test_names_refuse_what_has_no_place():
    with pytest.raises(names.UnknownKeyError, match="no place in the Hugging Face layout"):
        names.hf_name("mixins.ptuning.prefix.weight")
    with pytest.raises(names.UnknownKeyError, match="not a tensor of CogVLM/CogAgent"):
        names.sat_name("model.layers.0.self_attn.q_proj.weight")


@pytest.mark.parametrize("model_class", sorted(names.MODELS))
def test_auto_map_is_local_with_the_code_and_the_released_repository_without(model_class):
    """transformers reads ``"<repo>--<module>.<Class>"`` as code from ``<repo>`` (split at ``--``, then at ``.``):
    each hub reference names the module and class the local ``auto_map`` names, in the released repository."""
    from sat_patches.export.hf import _CODE
    local, hub = names.auto_map(model_class, True), names.auto_map(model_class, False)
    assert local == names.AUTO_MAP[model_class] and set(hub) == set(local) == {"AutoConfig", "AutoModelForCausalLM"}
    for auto, reference in hub.items():
        repo, ref = reference.split("--")
        assert repo == names.HUB_REPOS[model_class] and ref == local[auto]
        module, cls = ref.split(".")
        assert module + ".py" in _CODE[model_class]
    assert local["AutoModelForCausalLM"].endswith("." + names.MODELS[model_class])
    assert names.HUB_REPOS == {"CogVLMModel": "THUDM/cogvlm-chat-hf", "CogAgentModel": "THUDM/cogagent-chat-hf"}

"""sat_patches.cogvlm: our CogVLM/CogAgent SAT models at tiny size, and their data/tokenizer stand-ins.

Parameter names and shapes are checked against fixtures written by hand from upstream's model code
and released model_config.json (tests/fixtures/*.keys.json), not generated from our models.
"""
import sat_patches  # noqa: F401  (first: makes ``import sat`` work here)

import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from sat.model.base_model import get_model
from sat.training.model_io import extract_model_specific_args_to_dump

from sat_patches.cogvlm import (
    UPSTREAM_CONFIGS, CogAgentModel, CogVLMModel, EmptyDatasetError, FineTuneTrainCogAgentModel,
    FineTuneTrainCogVLMModel, ItemDataset, LlamaVisionExpertFCMixin, BlipImageEvalProcessor, check_vocab,
    data_collator, get_image_processor, llama2_text_processor, llama2_tokenizer, make_captcha_dataset,
    model_class_for, model_config_dict, read_model_config, save_pretrained_dir, tiny_args,
    train_tiny_tokenizer)
from sat_patches.cogvlm.eva_clip_large import EVA_CLIP_L_DEFAULTS

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
KINDS = {"cogvlm": "cogvlm-base-490", "cogagent": "cogagent-chat"}


# ----------------------------------------------------------------------------------------------
# shared tiny artefacts
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("cogvlm")


@pytest.fixture(scope="module")
def tokenizer_dir(workdir):
    return train_tiny_tokenizer(str(workdir / "tokenizer"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return llama2_tokenizer(tokenizer_dir, signal_type="base")


@pytest.fixture(scope="module")
def captcha_dir(workdir):
    path = str(workdir / "captcha")
    make_captcha_dataset(path, 6, seed=0)
    return path


def build(kind, **overrides):
    args = tiny_args(kind, **overrides)
    torch.manual_seed(0)
    return get_model(args, model_class_for(kind)), args


def make_batch(kind, args, tokenizer, data_dir, n=2):
    text = llama2_text_processor(tokenizer, args.max_length, args.image_length)
    image = get_image_processor(args.eva_args["image_size"][0])
    cross = get_image_processor(args.cross_image_pix) if kind == "cogagent" else None
    dataset = ItemDataset(image, text, args, data_dir, cross_image_processor=cross)
    return data_collator([dataset[i] for i in range(n)], cross_image_processor=cross)


def lm_loss(logits, labels):
    shift_labels = labels[..., 1:]
    shift_logits = logits[..., -1 - shift_labels.size(-1):-1, :].float()
    return torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                                             shift_labels.reshape(-1), ignore_index=-100)


# ----------------------------------------------------------------------------------------------
# parameter names and shapes vs upstream
# ----------------------------------------------------------------------------------------------

def load_fixture(kind):
    with open(os.path.join(FIXTURES, f"{KINDS[kind]}.keys.json")) as f:
        return json.load(f)


def shape_namespace(config):
    names = {k: v for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    names.update({"eva_" + k: v for k, v in config["eva_args"].items() if isinstance(v, (int, float))})
    if "cross_image_pix" in config:
        encoder = dict(EVA_CLIP_L_DEFAULTS, **config.get("encoder_args", {}))
        names.update({"enc_" + k: v for k, v in encoder.items()})
    return names


def evaluate(expr, names):
    return eval(expr, {"__builtins__": {}, "min": min, "int": int}, names)  # noqa: S307 (fixture text)


def normalise(key):
    return re.sub(r"\.\d+(?=\.|$)", ".N", key)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_dict_keys_and_shapes_match_upstream(kind):
    fixture = load_fixture(kind)
    model, args = build(kind)
    state = model.state_dict()
    assert {normalise(k) for k in state} == set(fixture["keys"])

    names = shape_namespace(model_config_dict(args))
    for key, tensor in state.items():
        expected = tuple(evaluate(e, names) for e in fixture["keys"][normalise(key)])
        assert tuple(tensor.shape) == expected, key

    for prefix, count in fixture["layer_counts"].items():
        indices = {int(k[len(prefix) + 1:].split(".")[0]) for k in state if k.startswith(prefix + ".")}
        assert indices == set(range(evaluate(count, names))), prefix

    params = {normalise(k) for k, _ in model.named_parameters()}
    assert params == set(fixture["keys"]) - set(fixture["buffers"])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_upstream_config_constants_match_fixture(kind):
    fixture = load_fixture(kind)
    assert UPSTREAM_CONFIGS[KINDS[kind]] == fixture["model_config"]
    if kind == "cogagent":
        assert {k: EVA_CLIP_L_DEFAULTS[k] for k in fixture["encoder_defaults"]} == fixture["encoder_defaults"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_full_size_shapes_from_fixture_are_upstream_sizes(kind):
    """The fixture's shape expressions at the released config give the released sizes."""
    fixture = load_fixture(kind)
    names = shape_namespace(fixture["model_config"])
    shape = lambda key: tuple(evaluate(e, names) for e in fixture["keys"][key])  # noqa: E731
    assert shape("mixins.eva.linear_proj.linear_proj.weight") == (4096, 1792)
    assert shape("transformer.layers.N.attention.query_key_value.weight") == (12288, 4096)
    if kind == "cogagent":
        assert shape("mixins.encoder.pos_embed") == (6400, 1024)
        assert shape("transformer.layers.N.cross_attention.key_value.weight") == (2048, 1024)
        assert shape("mixins.encoder.vit.model.blocks.N.mlp.w1.weight") == (2730, 1024)
    else:
        assert shape("mixins.eva.vit_model.transformer.position_embeddings.weight") == (1226, 1792)


def test_tiny_config_has_upstream_fields():
    for kind, name in KINDS.items():
        tiny = model_config_dict(tiny_args(kind))
        upstream = UPSTREAM_CONFIGS[name]
        assert set(tiny) <= set(upstream), kind
        optional = {"text_processor_version", "use_neft_noise"}
        assert set(upstream) - set(tiny) <= optional, kind
        assert set(tiny["eva_args"]) == set(upstream["eva_args"]), kind
        assert tiny["eva_args"]["hidden_size"] != 1792  # the projector width is derived, not hard-coded


def test_image_length_must_match_eva_grid():
    with pytest.raises(ValueError, match="image_length"):
        build("cogvlm", image_length=15)


def test_cogagent_cross_width_must_match_encoder():
    with pytest.raises(ValueError, match="cross_attn_hidden_size"):
        build("cogagent", cross_attn_hidden_size=32)


# ----------------------------------------------------------------------------------------------
# forward / backward on generated CAPTCHA batches
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_forward_gives_finite_logits_and_loss_backward(kind, tokenizer, captcha_dir):
    model, args = build(kind)
    batch = make_batch(kind, args, tokenizer, captcha_dir)
    labels = batch.pop("labels")
    model.train()
    logits = model(**batch)[0]
    assert logits.shape == (2, args.max_length, args.vocab_size)
    assert torch.isfinite(logits).all()
    loss = lm_loss(logits, labels)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()

    grads = {n: p.grad for n, p in model.named_parameters()}
    must_learn = ["mixins.rotary.vision_query_key_value_list.0.weight", "mixins.mlp.vision_gate_proj.0.weight",
                  "mixins.eva.vit_model.mixins.patch_embedding.proj.weight", "mixins.eva.linear_proj.gate_proj.weight",
                  "transformer.layers.0.attention.query_key_value.weight", "mixins.lm.lm_head.weight"]
    if kind == "cogagent":
        must_learn += ["transformer.layers.1.cross_attention.key_value.weight", "mixins.encoder.pos_embed",
                       "mixins.encoder.vit.model.blocks.0.attn.q_proj.weight", "mixins.eva.pos_embed"]
    for name in must_learn:
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    # as upstream, CogAgent's encoder skips its last block, final norm and head
    unused = sorted(n for n, g in grads.items() if g is None)
    if kind == "cogvlm":
        assert unused == []
    else:
        last = f"mixins.encoder.vit.model.blocks.{args.encoder_args['layers'] - 1}."
        skipped = (last, "mixins.encoder.vit.model.norm.", "mixins.encoder.vit.model.head.")
        assert unused == sorted(n for n in grads if n.startswith(skipped))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_image_reaches_the_text_positions(kind, tokenizer, captcha_dir):
    model, args = build(kind)
    model.eval()
    batch = make_batch(kind, args, tokenizer, captcha_dir)
    batch.pop("labels")
    with torch.no_grad():
        before = model(**batch)[0]
        other = dict(batch, vision_image=batch["vision_image"].flip(-1))
        after = model(**other)[0]
    first_image_slot = int(batch["image_embed_mask"][0].nonzero()[0])
    assert torch.equal(before[:, :first_image_slot], after[:, :first_image_slot])  # causal: bos sees no image
    assert not torch.allclose(before[:, first_image_slot:], after[:, first_image_slot:])
    if kind == "cogagent":
        with torch.no_grad():
            cross = model(**dict(batch, cross_image=batch["cross_image"].flip(-1)))[0]
        assert not torch.allclose(before, cross)


def test_vision_experts_route_only_image_tokens(tokenizer, captcha_dir):
    model, args = build("cogvlm")
    model.eval()
    batch = make_batch("cogvlm", args, tokenizer, captcha_dir)
    batch.pop("labels")
    expert = model.get_mixin("rotary").vision_query_key_value_list["0"].weight
    text_only = dict(batch, vision_expert_mask=torch.zeros_like(batch["vision_expert_mask"]))
    with torch.no_grad():
        routed, plain = model(**batch)[0], model(**text_only)[0]
        expert.mul_(2.0)
        routed2, plain2 = model(**batch)[0], model(**text_only)[0]
    assert not torch.allclose(routed, routed2)  # image tokens use the expert
    assert torch.equal(plain, plain2)  # without vision tokens the expert is never used

    # with the language weights copied in, the experts compute what the language path computes
    with torch.no_grad():
        model.get_mixin("rotary").copy_param()
        model.get_mixin("mlp").copy_param()
        copied, language = model(**batch)[0], model(**text_only)[0]
    assert torch.allclose(copied, language, atol=1e-5)


def test_mixins_follow_requested_dtype_and_device():
    mixin = LlamaVisionExpertFCMixin(32, 64, num_layers=2, num_vision_layers=2, params_dtype=torch.bfloat16,
                                     device="meta", skip_init=False)
    assert {(p.dtype, p.device.type) for p in mixin.parameters()} == {(torch.bfloat16, "meta")}

    args = tiny_args("cogagent")
    model = FineTuneTrainCogAgentModel(args, params_dtype=torch.bfloat16)
    ours = ("mixins.mlp.", "mixins.rotary.", "mixins.lm.", "mixins.encoder.", "mixins.eva.linear_proj.",
            "mixins.eva.boi", "mixins.eva.eoi", "mixins.eva.pos_embed", "mixins.eva.vit_model.mixins.")
    dtypes = {n: p.dtype for n, p in model.named_parameters() if n.startswith(ours)}
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}, {n for n, d in dtypes.items() if d != torch.bfloat16}



# ----------------------------------------------------------------------------------------------
# model_config.json and checkpoint folder round trip
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_model_config_round_trip(kind, tmp_path):
    model, args = build(kind)
    directory = save_pretrained_dir(model, args, str(tmp_path / "model"))
    written = read_model_config(directory)
    assert written == json.loads(json.dumps(model_config_dict(args)))
    assert list(written) == [k for k in UPSTREAM_CONFIGS[KINDS[kind]] if k in written]  # upstream's order
    assert written["model_class"] == args.model_class

    # what SAT itself would dump for this model agrees with every field we write
    sat_dump = json.loads(json.dumps(extract_model_specific_args_to_dump(args, model)))
    for key, value in written.items():
        if key in sat_dump:
            assert sat_dump[key] == value, key

    cls = FineTuneTrainCogAgentModel if kind == "cogagent" else FineTuneTrainCogVLMModel
    loaded, loaded_args = cls.from_pretrained(directory, None)
    assert isinstance(loaded, CogAgentModel if kind == "cogagent" else CogVLMModel)
    assert loaded_args.eva_args == args.eva_args and loaded_args.image_length == args.image_length
    reference, restored = model.state_dict(), loaded.state_dict()
    assert reference.keys() == restored.keys()
    assert all(torch.equal(reference[k], restored[k]) for k in reference)


# ----------------------------------------------------------------------------------------------
# data and tokenizer stand-ins
# ----------------------------------------------------------------------------------------------

def test_captcha_dataset_is_real_and_reproducible(tmp_path):
    a = make_captcha_dataset(str(tmp_path / "a"), 5, seed=3)
    b = make_captcha_dataset(str(tmp_path / "b"), 5, seed=3)
    c = make_captcha_dataset(str(tmp_path / "c"), 5, seed=4)
    stems = [os.path.splitext(os.path.basename(p))[0] for p in a]
    assert len(set(stems)) == 5 and all(len(s) == 4 and s.isalnum() for s in stems)
    assert [open(p, "rb").read() for p in a] == [open(p, "rb").read() for p in b]
    assert stems != [os.path.splitext(os.path.basename(p))[0] for p in c]
    pixels = np.asarray(Image.open(a[0]))
    assert pixels.shape == (60, 160, 3) and pixels.std() > 10  # drawn, not blank
    assert not set(stems) & {os.path.splitext(os.path.basename(p))[0]
                             for p in make_captcha_dataset(str(tmp_path / "d"), 5, seed=3, exclude=stems)}


def test_dataset_skips_and_counts_unreadable_images(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("SAT_PATCHES_BAD_RECORDS", "skip")
    monkeypatch.setenv("SAT_PATCHES_BAD_RECORDS_MAX", "0.5")
    folder = str(tmp_path / "data")
    paths = make_captcha_dataset(folder, 4, seed=1)
    with open(paths[0], "wb") as f:
        f.write(b"not a jpeg at all")
    data = open(paths[1], "rb").read()
    with open(paths[1], "wb") as f:
        f.write(data[: len(data) // 3])  # truncated JPEG
    text = llama2_text_processor(tokenizer, 80, 16)
    dataset = ItemDataset(get_image_processor(56), text, None, folder)
    assert len(dataset) == 2 and len(dataset.skipped) == 2
    assert sorted(p for p, _ in dataset.skipped) == sorted(paths[:2])
    item = dataset[0]
    assert item["question_id"] == os.path.splitext(os.path.basename(paths[2]))[0]
    assert item["vision"]["image"].shape == (1, 3, 56, 56)
    labels = item["labels"][0]
    answer = [t for t in labels.tolist() if t != -100]
    assert tokenizer.decode(answer, skip_special_tokens=True).strip() == item["question_id"]
    assert (labels[: int(item["context_length"])] == -100).all()  # prompt and image slots are masked


def test_dataset_refuses_a_folder_without_usable_images(tmp_path, tokenizer):
    from sat_patches.data.jsonl import DataError
    text = llama2_text_processor(tokenizer, 80, 16)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("ab12", "cd34"):
        (bad / f"{name}.jpg").write_bytes(b"\xff\xd8 broken")
    with pytest.raises(DataError, match=r"2 image\(s\) of .* cannot be used"):
        ItemDataset(get_image_processor(56), text, None, str(bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyDatasetError, match="no .jpg"):
        ItemDataset(get_image_processor(56), text, None, str(tmp_path / "empty"))
    with pytest.raises(EmptyDatasetError, match="does not exist"):
        ItemDataset(get_image_processor(56), text, None, str(tmp_path / "missing"))


def test_image_processor_normalises_like_clip():
    image = Image.new("RGB", (30, 20), (255, 0, 128))
    out = BlipImageEvalProcessor(56)(image)
    assert out.shape == (3, 56, 56)
    expected = (torch.tensor([1.0, 0.0, 128 / 255]) - torch.tensor([0.48145466, 0.4578275, 0.40821073])) \
        / torch.tensor([0.26862954, 0.26130258, 0.27577711])
    assert torch.allclose(out.mean(dim=(1, 2)), expected, atol=1e-4)
    inputs = get_image_processor(56)(image)
    assert inputs["image"].shape == (1, 3, 56, 56) and inputs["position_ids"] is None
    assert inputs["input_ids"].tolist() == [[0]] and inputs["attention_mask"].tolist() == [[1]]


def test_tokenizer_fits_model_and_pads_with_unk(tokenizer_dir, tokenizer, tmp_path):
    args = tiny_args("cogvlm")
    check_vocab(tokenizer, args.vocab_size, args.pad_token_id)
    assert tokenizer.pad_token == "<unk>" and tokenizer.pad_token_id == 0  # vicuna's choice
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    for label in ("a3k9", "zz00x"):
        ids = tokenizer.encode(label, add_special_tokens=False)
        assert tokenizer.decode(ids) == label
    with pytest.raises(ValueError, match="vocab_size"):
        check_vocab(tokenizer, 300)

    # a tokenizer folder without a pad token: upstream would set 32000, out of range here
    no_pad = tmp_path / "no_pad"
    no_pad.mkdir()
    for name in os.listdir(tokenizer_dir):
        data = open(os.path.join(tokenizer_dir, name), "rb").read()
        if name.endswith(".json"):
            config = json.loads(data)
            config.pop("pad_token", None)
            data = json.dumps(config).encode()
        (no_pad / name).write_bytes(data)
    reloaded = llama2_tokenizer(str(no_pad), signal_type="chat")
    assert reloaded.pad_token_id == reloaded.unk_token_id == 0
    assert reloaded.signal_type == "chat" and reloaded.boi == "[IMG]"


def test_text_processor_layout(tokenizer):
    text = llama2_text_processor(tokenizer, 80, 16)
    out = text("a3k9", "CAPTCHA:")
    eoi = out["image_position"][0]
    vision = out["vision_expert_mask"][0]
    assert vision.sum() == 17 and vision[eoi - 17:eoi].all()  # boi + 16 image tokens
    assert out["image_embed_mask"][0].sum() == 18
    positions = out["position_ids"][0]
    assert len(set(positions[eoi - 16:eoi].tolist())) == 1  # image tokens share one rotary position
    assert out["attention_mask"].shape == (1, 1, 80, 80)
    assert text("x" * 10, "CAPTCHA:" + " word" * 40) is None  # upstream: prompt leaves < 50 tokens


def test_classes_are_in_sats_registry_without_replacing_sats_eva():
    from sat.model.official.eva_clip_model import EVA2CLIPModel as SatEVA
    from sat.model.registry import model_registry
    for cls in (CogVLMModel, FineTuneTrainCogVLMModel, CogAgentModel, FineTuneTrainCogAgentModel):
        assert model_registry.get(cls.__name__) is cls
    assert model_registry.get("EVA2CLIPModel") is SatEVA


def test_cross_encoder_rope_depends_on_relative_2d_position():
    from sat_patches.cogvlm.eva_clip_large import VisionRotary
    from sat_patches.cogvlm.placement import Placement
    grid = 4
    rope = VisionRotary(half_head_dim=8, pt_seq_len=16, grid=grid, placement=Placement.resolve(torch.float64, "cpu"))
    assert rope.freqs_cos.shape == (grid * grid, 16)
    torch.manual_seed(0)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    rotated_q = rope(q.expand(grid * grid, 16))
    rotated_k = rope(k.expand(grid * grid, 16))
    assert torch.allclose(rotated_q.norm(dim=-1), q.norm().expand(grid * grid))
    at = lambda row, col: row * grid + col  # noqa: E731  (row-major, as the patches are flattened)
    dot = lambda a, b: float(rotated_q[at(*a)] @ rotated_k[at(*b)])  # noqa: E731
    assert dot((2, 1), (0, 3)) == pytest.approx(dot((3, 1), (1, 3)))  # same (row, col) offset
    assert dot((2, 1), (0, 3)) == pytest.approx(dot((2, 0), (0, 2)))
    assert dot((2, 1), (0, 3)) != pytest.approx(dot((2, 1), (1, 3)))  # different offset


@pytest.mark.parametrize("kind", ["cogvlm", "cogagent"])
def test_greedy_decoding_runs_each_image_tower_once_a_sample_and_decodes_the_same_tokens(kind, tokenizer,
                                                                                        captcha_dir):
    """The evaluation's decoding re-runs the model on the whole sequence for every token; the image towers run on
    the sample's image once (``evaluation.towers_run_once``), and the tokens are those of the plain decoding."""
    import collections
    from sat_patches.cogvlm import evaluation
    model, args = build(kind)
    model.eval()
    batch = make_batch(kind, args, tokenizer, captcha_dir, n=1)
    towers = {n: m for n, m in model.named_modules() if n in evaluation.IMAGE_TOWERS}
    assert len(towers) == (2 if kind == "cogagent" else 1), sorted(towers)
    calls = collections.Counter()
    for name, tower in towers.items():
        for child in tower.children():
            child.register_forward_hook(lambda *_, name=name: calls.update([name]))

    def decode(run):
        calls.clear()
        with torch.no_grad():  # eos -1: never said, so each decodes its 4 tokens
            return run(model, batch, evaluation.model_inputs(batch), -1, 4), dict(calls)
    def towers_once(*decode_args):
        with evaluation.towers_run_once(model):
            return evaluation._decode(*decode_args)
    plain, plain_calls = decode(evaluation._decode)
    once, once_calls = decode(towers_once)
    assert once == plain and len(plain) == 4
    assert plain_calls == {name: 4 * n for name, n in once_calls.items()} and all(once_calls.values()), \
        (plain_calls, once_calls)
    assert all("forward" not in vars(tower) for tower in towers.values())  # the class's forward again afterwards

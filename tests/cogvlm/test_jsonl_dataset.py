"""The JSONL conversation dataset on the tiny CogVLM: loss on answer tokens only (checked token by token),
records too long for max_length, the standalone trainer at MP=2 on 2 CPU ranks, and an empty data set
refused before the model is built."""
import json
import os

import pytest

from multirank import run_ranks
from sat_patches.runner import finetune_run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sat_patches.cogvlm import prepare_tiny_run
    return prepare_tiny_run(str(tmp_path_factory.mktemp("jsonl")), "cogvlm", n_train=6, n_valid=2)


def dataset(tiny, path, version="chat", max_length=120, answer_room=None):
    from sat_patches.cogvlm import JsonlDataset, get_image_processor, llama2_text_processor, llama2_tokenizer, tiny_args
    args = tiny_args("cogvlm")
    tokenizer = llama2_tokenizer(tiny.tokenizer_dir, signal_type=version)
    text = llama2_text_processor(tokenizer, max_length, args.image_length)
    if answer_room is not None:
        text.answer_room = answer_room  # upstream's processor keeps 10 tokens for the answer, ours 50
    return JsonlDataset(get_image_processor(args.eva_args["image_size"][0]), text, args, path), tokenizer


def test_a_turn_is_rendered_with_its_history_and_only_its_answer_carries_loss(tiny):
    data, tokenizer = dataset(tiny, tiny.train_jsonl)
    index = next(i for i, s in enumerate(data.data) if s.history)         # the second turn of a conversation
    sample, item = data.data[index], data[index]
    ids, labels = item["input_ids"][0].tolist(), item["labels"][0].tolist()
    context = int(item["context_length"][0])
    # (the image slots are token 0; transformers before 4.42 decodes the first piece's word boundary as a space)
    prompt = tokenizer.decode([t for t in ids[:context] if t > 2]).lstrip(" ")
    assert prompt == f"[INST] How many characters? [/INST] {len(sample.answer)} [INST] CAPTCHA: [/INST] "
    answer = tokenizer.encode(sample.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    trained = [(i, t) for i, t in enumerate(labels) if t != -100]
    assert [t for _, t in trained] == answer                              # token by token: the answer and </s>
    assert [i for i, _ in trained] == list(range(context, context + len(answer)))
    assert [ids[i] for i, _ in trained] == answer
    boxes = [data[i] for i, s in enumerate(data.data) if "[[" in s.answer]
    assert tokenizer.decode([t for t in boxes[0]["labels"][0].tolist() if t != -100]) == "[[50,100,950,900]]</s>"


def test_a_record_longer_than_max_length_is_named_and_refused_or_skipped(tiny, monkeypatch):
    from sat_patches.data.jsonl import DataError
    monkeypatch.delenv("SAT_PATCHES_BAD_RECORDS", raising=False)
    with pytest.raises(DataError, match=r"train.jsonl:3: 43 tokens with the image \(26 before the answer\) do not "
                                        r"fit max_length 40: shorten the record or raise --max_length"):
        dataset(tiny, tiny.train_jsonl, version="base", max_length=40, answer_room=10)
    monkeypatch.setenv("SAT_PATCHES_BAD_RECORDS", "skip")
    monkeypatch.setenv("SAT_PATCHES_BAD_RECORDS_MAX", "0.3")  # 2 of 8 are too long
    with pytest.warns(UserWarning, match="left out 2 of 8 record"):
        data, _ = dataset(tiny, tiny.train_jsonl, version="base", max_length=40, answer_room=10)
    assert len(data) == 6 and not any("[[" in s.answer for s in data.data)


def train_recording(argv, build_must_not_happen=False):
    """``standalone.train(argv)`` on this rank: its losses and whether the model was built."""
    import math
    from sat_patches.cogvlm import standalone
    from sat_patches.cogvlm import models
    built, losses, step = [], [], standalone.forward_step
    original_init = models.FineTuneTrainCogVLMModel.__init__

    def init(self, *a, **kw):
        built.append(1)
        original_init(self, *a, **kw)

    def forward_step(*a, **kw):
        loss, metrics = step(*a, **kw)
        losses.append(float(loss))
        return loss, metrics

    models.FineTuneTrainCogVLMModel.__init__, standalone.forward_step = init, forward_step
    try:
        standalone.train(argv)
        error = None
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    finally:
        models.FineTuneTrainCogVLMModel.__init__, standalone.forward_step = original_init, step
    return {"built": bool(built), "losses": losses, "finite": all(math.isfinite(x) for x in losses), "error": error}


def _argv(tiny, tmp_path, train, valid, mp):
    env = finetune_run.settings({"MODEL_KIND": "cogvlm", "CPU_RANKS": "2", "MP_SIZE": str(mp), "TRAIN_ITERS": "3",
                                 "LOG_INTERVAL": "1", "VERSION": "chat", "MAX_LENGTH": "120",
                                 "CUDA_VISIBLE_DEVICES": ""})
    options = finetune_run.train_options(env, model=tiny.model_dir, tokenizer=tiny.tokenizer_dir, train=train,
                                         valid=valid, save=str(tmp_path / "checkpoints"),
                                         ds_config=finetune_run.config_path("cpu_demo.json"))
    return ["--kind", "cogvlm", *options]


@pytest.mark.slow  # end to end on CPU ranks (over 10 s)
@pytest.mark.multirank
def test_the_standalone_cogvlm_trains_on_conversations_at_mp2(tiny, tmp_path):
    argv = _argv(tiny, tmp_path, tiny.train_jsonl, tiny.valid_jsonl, mp=2)
    results = run_ranks(train_recording, 2, args=(argv,), timeout=300, env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    for r in results:
        assert r.result is not None and r.result["error"] is None, f"{r.exception or r.result}{r.output[-4000:]}"
        assert r.result["built"] and len(r.result["losses"]) == 3 and r.result["finite"], r.result
    assert results[0].result["losses"] == results[1].result["losses"]  # model-parallel ranks: one loss


@pytest.mark.slow  # SAT's training_main up to its data (~7 s)
@pytest.mark.multirank
def test_an_empty_data_set_is_refused_before_the_model_is_built(tiny, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    argv = _argv(tiny, tmp_path, str(empty), tiny.valid_jsonl, mp=1)
    [r] = run_ranks(train_recording, 1, args=(argv,), timeout=120, env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    assert r.result is not None, (r.exception or "") + r.output[-3000:]
    assert not r.result["built"]
    assert r.result["error"] == f"DataError: {empty} holds no usable sample: add records, one JSON object per line"


def test_create_dataset_function_takes_both_upstream_signatures(tiny):
    from sat_patches.cogvlm import ItemDataset, JsonlDataset, create_dataset_function
    data, _ = dataset(tiny, tiny.valid_jsonl)
    image, text, args = data.image_processor, data.text_processor, None
    cogagent_demo = create_dataset_function(image, text, None, tiny.valid_jsonl, args)   # (image, text, cross, path, args)
    cogvlm_demo = create_dataset_function(image, text, tiny.valid_dir, args)              # (image, text, path, args)
    assert isinstance(cogagent_demo, JsonlDataset) and len(cogagent_demo) == len(data)
    assert type(cogvlm_demo) is ItemDataset and len(cogvlm_demo) == len(os.listdir(tiny.valid_dir))
    with pytest.raises(TypeError, match="takes \\(image_processor, text_processor"):
        create_dataset_function(image, text, tiny.valid_dir)

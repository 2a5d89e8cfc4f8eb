"""The CPU demo's task: coloured shapes drawn locally, a tokenizer with one piece per answer, a tiny model whose
output head lets answers become confident."""
import hashlib
import json
import os

import pytest


def digest(folder):
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


def test_same_seed_same_images_and_records_every_colour_equally(tmp_path):
    from sat_patches.cogvlm.shapes_data import COLOURS, PROMPT, make_shapes_dataset
    from sat_patches.data.jsonl import check_data_path
    a, b, c = (str(tmp_path / name / "train.jsonl") for name in "abc")
    assert make_shapes_dataset(a, 12, seed=0) == make_shapes_dataset(b, 12, seed=0) == 12
    make_shapes_dataset(c, 12, seed=1)
    assert digest(tmp_path / "a" / "train") == digest(tmp_path / "b" / "train") != digest(tmp_path / "c" / "train")
    assert check_data_path(a) == []  # valid records in the format training reads
    with open(a) as f:
        records = [json.loads(line) for line in f]
    assert {r["prompt"] for r in records} == {PROMPT}
    assert sorted(r["answer"] for r in records) == sorted(list(COLOURS) * 3)


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory):
    from sat_patches.cogvlm import prepare_tiny_run
    return prepare_tiny_run(str(tmp_path_factory.mktemp("shapes")), "cogvlm", n_train=4, n_valid=4, task="shapes")


def test_every_answer_is_one_token(shapes_run):
    from sat_patches.cogvlm import llama2_tokenizer
    from sat_patches.cogvlm.shapes_data import COLOURS, SHAPES
    tokenizer = llama2_tokenizer(shapes_run.tokenizer_dir)
    assert all(len(tokenizer.tokenize(word)) == 1 for word in (*COLOURS, *SHAPES))


def test_output_head_can_make_an_answer_confident(shapes_run):
    """After the final RMSNorm the hidden state has norm sqrt(128): the largest logit a head row can give is
    |row| * sqrt(128). SAT's init (std 0.02) bounds it near 2.6, which keeps the softmax over the vocabulary
    near-uniform; the demo's model reaches ten times that."""
    import torch
    from sat_patches.cogvlm import build_tiny_model
    from sat_patches.checkpoints import safe_load
    from sat_patches.cogvlm.tiny import HEAD_SCALE
    [states] = [os.path.join(root, f) for root, _, files in os.walk(shapes_run.model_dir) for f in files
                if f.endswith("model_states.pt")]
    head = safe_load.load(states)["module"]["mixins.lm.lm_head.weight"]
    stock = build_tiny_model("cogvlm", seed=1234)[0].get_mixin("lm").lm_head.weight.detach()
    torch.testing.assert_close(head, stock * HEAD_SCALE)  # the same random model, its head scaled
    bound = lambda w: float(w.norm(dim=1).max()) * 128 ** 0.5  # noqa: E731
    assert bound(stock) < 3.5 and bound(head) > 25

"""``python -m sat_patches evaluate``: every sample answered once over the data-parallel ranks, the same
predictions at any model-parallel size, scores consistent with the lines written, bad input refused."""
import json
import os

import pytest

from sat_patches.cogvlm import evaluation, scores
from multirank import run_ranks


def test_scores():
    assert scores.char_score("ab12", "ab12") == 1.0
    assert scores.char_score("ab1", "ab12") == 0.75       # over the longer of the two
    assert scores.char_score("xb12zz", "ab12") == 0.5
    assert scores.char_score("", "") == 1.0 and scores.char_score("", "ab") == 0.0
    rows = [{"prediction": "ab12", "answer": "ab12", "exact": True},
            {"prediction": "ab13", "answer": "ab12", "exact": False}]
    assert scores.summarise(rows) == {"samples": 2, "exact_match": 1, "accuracy": 0.5, "char_accuracy": 0.875}


def test_bad_input_is_refused_before_anything_is_loaded(tmp_path):
    (tmp_path / "empty").mkdir()
    problems = evaluation.check_inputs(str(tmp_path / "nowhere"), str(tmp_path / "empty"), mp=2, world=3)
    assert len(problems) == 3
    assert "checkpoint directory" in problems[0] and "does not exist" in problems[0]
    assert "holds no readable .jpg image" in problems[1]
    assert "--mp 2 does not divide the 3 rank(s)" in problems[2] and "[1, 3]" in problems[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sat_patches.cogvlm import prepare_tiny_run
    return prepare_tiny_run(str(tmp_path_factory.mktemp("evaluate")), "cogvlm", n_train=3, n_valid=5)


def _evaluated(tiny, out, ranks, mp):
    results = run_ranks("sat_patches.cogvlm.evaluation:evaluate", ranks, timeout=300,
                        args=(tiny.model_dir, tiny.valid_jsonl, tiny.tokenizer_dir, mp, out),
                        kwargs={"max_length": 80, "max_new_tokens": 4}, env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    for r in results:
        assert r.ok, (r.exception or "") + r.output[-4000:]
    with open(os.path.join(out, "predictions.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return results[0].result, lines, results[0].output


@pytest.mark.slow
@pytest.mark.multirank
def test_predictions_are_the_same_at_mp2_at_mp1_and_over_two_data_parallel_ranks(tiny, tmp_path):
    one, one_lines, _ = _evaluated(tiny, str(tmp_path / "mp1"), 1, 1)
    mp2, mp2_lines, output = _evaluated(tiny, str(tmp_path / "mp2"), 2, 2)
    dp2, dp2_lines, _ = _evaluated(tiny, str(tmp_path / "dp2"), 2, 1)
    assert len(one_lines) == 5 and [l["id"] for l in one_lines] == sorted(os.path.splitext(f)[0]
                                                                          for f in os.listdir(tiny.valid_dir))
    assert any(l["prediction"] for l in one_lines)   # a random tiny model says something
    assert mp2_lines == one_lines and dp2_lines == one_lines
    assert (mp2["mp"], mp2["data_parallel"], dp2["mp"], dp2["data_parallel"]) == (2, 1, 1, 2)
    assert mp2["exact_match"] == sum(l["exact"] for l in mp2_lines) and mp2["samples"] == 5
    with open(tmp_path / "mp2" / "summary.json") as f:
        assert json.load(f)["char_accuracy"] == mp2["char_accuracy"]
    assert "evaluation: exact match " in output and "/5 (" in output


def test_an_answer_leaves_out_the_padded_vocabularys_slots(monkeypatch):
    """SAT pads the vocabulary past the tokenizer's; a padding id decoded by transformers before 4.42 raises
    ("piece id is out of range"), so the answer holds only ids the tokenizer has."""
    import contextlib
    from sat_patches.cogvlm import evaluation

    class Tokenizer:
        eos_token_id = 2

        def __len__(self):
            return 100

        def decode(self, ids):
            if any(i >= 100 for i in ids):
                raise IndexError("piece id is out of range.")
            return " ".join(map(str, ids))

    monkeypatch.setattr(evaluation, "_decode", lambda *a: [5, 120, 7])
    monkeypatch.setattr(evaluation, "model_inputs", lambda batch: batch)
    monkeypatch.setattr(evaluation, "towers_run_once", lambda model: contextlib.nullcontext())
    assert evaluation.greedy_answer(None, {}, Tokenizer()) == "5 7"

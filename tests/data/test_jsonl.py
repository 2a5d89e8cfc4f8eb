"""JSONL fine-tuning records: every kind of bad record named by file and line, the skip/refuse setting,
empty data, and the checks the scripts run before launching."""
import contextlib
import json
import os

import pytest
from PIL import Image

from sat_patches.data import jsonl


@pytest.fixture
def folder(tmp_path):
    Image.new("RGB", (32, 16), "white").save(tmp_path / "ok.jpg")
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return tmp_path


def write(folder, lines):
    path = folder / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


GOOD = {"image": "ok.jpg", "prompt": "CAPTCHA:", "answer": "ab12"}


@pytest.mark.parametrize("record, message", [
    ('{"image": "ok.jpg", "prompt": ', "not valid JSON"),
    ('["ok.jpg", "CAPTCHA:", "ab12"]', "a record must be a JSON object"),
    ({"prompt": "CAPTCHA:", "answer": "ab12"}, "\"image\" (the path of the record's image) is missing"),
    ({"image": "missing.jpg", "prompt": "CAPTCHA:", "answer": "ab12"}, "missing.jpg does not exist"),
    ({"image": "broken.jpg", "prompt": "CAPTCHA:", "answer": "ab12"}, "broken.jpg cannot be read"),
    ({"image": "ok.jpg", "prompt": "CAPTCHA:"}, "give \"prompt\" and \"answer\" (strings), or \"conversations\""),
    ({"image": "ok.jpg", "prompt": "CAPTCHA:", "answer": "  "}, "empty answer: give the text"),
    ({"image": "ok.jpg", "conversations": []}, "'conversations' must be a non-empty list"),
    ({"image": "ok.jpg", "conversations": [{"user": "Hi"}]}, "turn 1 must be {\"user\": \"...\", \"assistant\""),
    ({"image": "ok.jpg", "conversations": [{"user": "a", "assistant": "b"}, {"user": "c", "assistant": ""}]},
     "empty answer (turn 2)"),
    ({"image": "ok.jpg", "prompt": "Where?", "answer": "[[10,20,300]]"}, "box [[10,20,300]] is not four whole numbers"),
    ({"image": "ok.jpg", "prompt": "Where?", "answer": "[[10,20,300,1000]]"}, "from 0 to 999"),
    ({"image": "ok.jpg", "prompt": "Where?", "answer": "[[500,20,300,40]]"}, "x0 > x1 or y0 > y1"),
], ids=["json", "not-object", "no-image", "missing-image", "unreadable-image", "no-answer", "empty-answer",
        "empty-conversation", "bad-turn", "empty-turn-answer", "box-three", "box-range", "box-order"])
def test_each_bad_record_is_refused_with_its_file_and_line(folder, record, message, monkeypatch):
    monkeypatch.delenv(jsonl.SETTING, raising=False)
    path = write(folder, [GOOD, record])
    with pytest.raises(jsonl.DataError) as info:
        jsonl.settle(*jsonl.read_samples(path), path)
    text = str(info.value)
    assert f"{path}:2: " in text and message in text and f"{path}:1" not in text, text
    assert "set SAT_PATCHES_BAD_RECORDS=skip" in text


def test_skip_leaves_bad_records_out_and_counts_them(folder, monkeypatch):
    monkeypatch.setenv(jsonl.SETTING, "skip")
    monkeypatch.setenv(jsonl.MAX_SETTING, "50%")  # 1 of 3 is bad
    path = write(folder, [GOOD, {"image": "missing.jpg", "prompt": "a", "answer": "b"}, "", GOOD])
    with pytest.warns(UserWarning, match=r"left out 1 of 3 record\(s\) of .*data.jsonl:\n  .*:2: image"):
        samples = jsonl.settle(*jsonl.read_samples(path), path)
    assert [s.where for s in samples] == [f"{path}:1", f"{path}:4"]
    monkeypatch.setenv(jsonl.SETTING, "ignore")
    with pytest.raises(jsonl.DataError, match="SAT_PATCHES_BAD_RECORDS='ignore': set it to refuse"):
        jsonl.settle(*jsonl.read_samples(path), path)


def test_a_conversation_gives_one_sample_per_turn_with_the_turns_before_it_as_history(folder):
    turns = [{"user": "How many?", "assistant": "4"}, {"user": "Where?", "assistant": "[[1,2,3,4;5,6,7,8]]"}]
    path = write(folder, [{"image": os.path.join(str(folder), "ok.jpg"), "conversations": turns, "id": 7}])
    samples, problems = jsonl.read_samples(path)
    assert not problems
    assert [(s.query, s.answer, s.history, s.id) for s in samples] == [
        ("How many?", "4", [], "7"), ("Where?", "[[1,2,3,4;5,6,7,8]]", [("How many?", "4")], "7")]
    assert samples[1].where == f"{path}:1 (turn 2)" and samples[0].image == str(folder / "ok.jpg")


@pytest.mark.parametrize("lines, message", [
    ([], "holds no usable sample: add records"),
    ([{"image": "missing.jpg", "prompt": "a", "answer": "b"}], "holds no usable sample (every record had a problem)"),
], ids=["empty-file", "all-bad"])
def test_an_empty_dataset_is_refused(folder, lines, message, monkeypatch):
    monkeypatch.setenv(jsonl.SETTING, "skip")
    path = write(folder, lines)
    with pytest.raises(jsonl.EmptyDatasetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with pytest.warns(UserWarning) if lines else contextlib.nullcontext():
            jsonl.settle(*jsonl.read_samples(path), path)


def test_data_paths_are_checked_without_building_anything(folder, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "1 image(s) of" in jsonl.check_data_path(str(folder))[0]  # broken.jpg: refused by default
    (folder / "broken.jpg").unlink()
    assert jsonl.check_data_path(str(folder)) == []  # ok.jpg is readable
    assert "holds no readable .jpg image (0 .jpg files)" in jsonl.check_data_path(str(empty))[0]
    assert "does not exist" in jsonl.check_data_path(str(tmp_path / "nowhere"))[0]
    assert jsonl.check_data_path(write(folder, [GOOD])) == []
    assert "holds no usable sample" in jsonl.check_data_path(write(folder, []))[0]

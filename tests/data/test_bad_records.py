"""One bad-record policy for image folders and JSONL files: ``refuse`` by default; ``skip`` names every
record left out and refuses when more than ``SAT_PATCHES_BAD_RECORDS_MAX`` (default 10%) are bad. Walks
of data folders do not enter symlinked folders."""
import json
import os

import pytest
from PIL import Image

from sat_patches.data import jsonl
from multirank import run_ranks


def images(folder, good, bad):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(good):
        Image.new("RGB", (16, 8), "white").save(folder / f"good{i}.jpg")
    for i in range(bad):
        (folder / f"bad{i}.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return str(folder)


def folder_dataset(path):
    from sat_patches.cogvlm.dataset import ItemDataset
    return ItemDataset(lambda image: {}, lambda answer, prompt: {}, None, path)


def test_a_folder_with_9_of_10_unreadable_images_is_refused_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(jsonl.SETTING, raising=False)
    path = images(tmp_path / "data", good=1, bad=9)
    with pytest.raises(jsonl.DataError, match=r"9 image\(s\) of .* cannot be used:\n  .*bad0.jpg: cannot be read"):
        folder_dataset(path)
    assert "9 image(s) of" in jsonl.check_data_path(path)[0]
    monkeypatch.setenv(jsonl.SETTING, "skip")  # and with skip: more than 10% are bad
    with pytest.raises(jsonl.DataError, match=r"9 of 10 images .* \(90%\) cannot be used, more than "
                                              r"SAT_PATCHES_BAD_RECORDS_MAX=0.1 allows"):
        folder_dataset(path)
    assert "more than SAT_PATCHES_BAD_RECORDS_MAX" in jsonl.check_data_path(path)[0]


def test_skip_trains_on_the_good_images_and_reports_each_bad_one(tmp_path, monkeypatch):
    monkeypatch.setenv(jsonl.SETTING, "skip")
    monkeypatch.setenv(jsonl.MAX_SETTING, "95%")
    path = images(tmp_path / "data", good=1, bad=9)
    with pytest.warns(jsonl.DataWarning) as caught:
        data = folder_dataset(path)
    assert data.data == [os.path.join(path, "good0.jpg")]
    message = str(caught[0].message)
    assert "left out 9 of 10 image(s)" in message
    for i in range(9):
        assert f"{os.path.join(path, f'bad{i}.jpg')}: cannot be read" in message


def test_skip_reports_every_bad_jsonl_record_by_file_and_line_and_refuses_past_the_limit(tmp_path, monkeypatch):
    images(tmp_path, good=1, bad=0)
    good = {"image": "good0.jpg", "prompt": "CAPTCHA:", "answer": "ab12"}
    bad = {"image": "missing.jpg", "prompt": "CAPTCHA:", "answer": "ab12"}
    path = str(tmp_path / "data.jsonl")
    lines = [bad if n % 8 == 0 else good for n in range(100)]  # 13 bad of 100
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    monkeypatch.setenv(jsonl.SETTING, "skip")
    with pytest.raises(jsonl.DataError, match=r"13 of 100 records .* \(13%\) cannot be used, more than"):
        jsonl.settle(*jsonl.read_samples(path), path)
    monkeypatch.setenv(jsonl.MAX_SETTING, "0.2")
    with pytest.warns(jsonl.DataWarning) as caught:
        samples = jsonl.settle(*jsonl.read_samples(path), path)
    assert len(samples) == 87
    for n in range(0, 100, 8):  # every one, by file:line
        assert f"{path}:{n + 1}: image" in str(caught[0].message)
    monkeypatch.setenv(jsonl.MAX_SETTING, "lots")
    with pytest.raises(ValueError, match="SAT_PATCHES_BAD_RECORDS_MAX='lots': set it to a share from 0 to 1"):
        jsonl.settle(*jsonl.read_samples(path), path)


def checked_and_found(path):
    """(a rank, ended at the timeout if a walk never ends) the folder's check and its images."""
    return jsonl.check_data_path(path), jsonl.folder_images(path)


@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
@pytest.mark.multirank
def test_a_symlink_loop_in_a_data_folder_ends_the_check(tmp_path):
    path = images(tmp_path / "data", good=1, bad=0)
    os.symlink(".", os.path.join(path, "loop"))
    os.symlink(".", os.path.join(path, "again"))
    [r] = run_ranks(checked_and_found, 1, args=(path,), timeout=60)
    assert r.ok, r.exception or r.output[-2000:]
    assert r.result == ([], [os.path.join(path, "good0.jpg")])


def test_a_relative_adapter_base_path_resolves_from_the_adapters_folder(tmp_path, monkeypatch):
    from sat_patches.checkpoints import adapter
    folder = tmp_path / "runs" / "lora" / "100"
    folder.mkdir(parents=True)
    (folder / adapter.MANIFEST).write_text(json.dumps(
        {"base": {"path": "../../../base", "iteration": 1, "sha256": "0" * 64}}))
    monkeypatch.chdir(tmp_path / "runs")
    assert adapter.read_manifest(str(folder))["base"]["path"] == str(tmp_path / "base")

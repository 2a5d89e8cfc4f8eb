"""Without a GPU, both the standalone run and a checkout's CPU smoke test (CPU_RANKS) use the user's
TRAIN_DATA / VALID_DATA and TRAIN_ITERS: an empty data folder is refused before launch, a user's JSONL
file is what trains, and each setting a CPU run cannot honour is named with why. A whole run on the user's
records is tests/runner/test_finetune_scripts.py's CogAgent run."""
import json

import pytest
from PIL import Image

from test_checkout_cpu import SCRIPTS, checkout_with_script, run

UNIQUE = "only-in-the-users-file-42"


def user_jsonl(folder, n=6):
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        Image.new("RGB", (60, 24), (40 * i, 90, 200)).save(folder / f"img{i}.jpg")
        records.append({"image": f"img{i}.jpg", "prompt": "CAPTCHA:", "answer": f"zq{i}8",
                        "id": UNIQUE if i == 0 else f"user-{i}"})
    path = folder / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def train_line(out):
    return next(line for line in out.stdout.splitlines() if line.startswith("+ ") and "--train-data" in line)


@pytest.mark.parametrize("where", ["standalone", "checkout"])
def test_an_empty_train_data_folder_is_refused_before_launch(tmp_path, where):
    script = SCRIPTS["cogvlm"] if where == "standalone" else checkout_with_script(tmp_path, "cogvlm")[1]
    (tmp_path / "empty").mkdir()
    out = run(script, {"DRY_RUN": "1", "CPU_RANKS": "2", "TRAIN_DATA": "empty"}, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:]
    assert f"TRAIN_DATA={tmp_path / 'empty'}: data folder {tmp_path / 'empty'} holds no readable .jpg image" in out.stderr


def test_the_standalone_cpu_run_trains_on_the_users_jsonl_for_the_users_iterations(tmp_path):
    data = user_jsonl(tmp_path / "data")
    out = run(SCRIPTS["cogvlm"], {"DRY_RUN": "1", "CPU_RANKS": "2", "TRAIN_DATA": "data/mine.jsonl",
                                  "TRAIN_ITERS": "3", "MODEL_TYPE": "cogvlm-chat-v1.1", "MAX_LENGTH": "1288"},
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    train = train_line(out)
    assert f"--train-data {data}" in train and "--train-iters 3" in train and "--max_length 512" in train
    assert "note: MAX_LENGTH=1288 is cut to 512: the tiny model has 512 positions" in out.stdout
    assert "--valid-data " + str(tmp_path / "sat_patches_demo" / "cogvlm" / "data" / "valid.jsonl") in train
    assert f"note: TRAIN_DATA: {data}" in out.stdout
    assert "note: VALID_DATA not set: generated coloured shapes are used" in out.stdout
    assert "note: MODEL_TYPE=cogvlm-chat-v1.1 is not used on CPU ranks: a tiny model" in out.stdout


@pytest.mark.parametrize("run_mode, generated", [("cpu", "coloured shapes"), ("checkout-cpu", "CAPTCHA images")])
def test_the_notes_name_the_data_a_cpu_run_generates(run_mode, generated, tmp_path, monkeypatch):
    from sat_patches.runner import finetune_run
    monkeypatch.chdir(tmp_path)  # the commands write the run's DeepSpeed config under WORK_DIR
    env = finetune_run.settings({"MODEL_KIND": "cogvlm", "CPU_RANKS": "2"})
    assert finetune_run.cpu_notes(env, {}, run_mode)[:2] == [
        f"TRAIN_DATA not set: generated {generated} are used", f"VALID_DATA not set: generated {generated} are used"]
    if run_mode == "cpu":  # what the demo's prepare step is asked to draw
        prepare = finetune_run.cpu_commands(dict(env, MASTER_PORT="1"), "cogvlm")[0]
        assert prepare[prepare.index("--task") + 1] == "shapes"


def test_a_checkout_smoke_test_trains_on_the_users_folder_and_refuses_jsonl_its_demo_cannot_read(tmp_path):
    _, script = checkout_with_script(tmp_path, "cogvlm")
    folder = tmp_path / "train"
    folder.mkdir()
    Image.new("RGB", (60, 24), "white").save(folder / "ab12.jpg")
    out = run(script, {"DRY_RUN": "1", "CPU_RANKS": "2", "TRAIN_DATA": "train", "VALID_DATA": "train",
                       "TRAIN_ITERS": "3"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    train = train_line(out)
    assert f"--train-data {folder} " in train and f"--valid-data {folder} " in train and "--train-iters 3" in train
    data = user_jsonl(tmp_path / "data")
    out = run(script, {"DRY_RUN": "1", "CPU_RANKS": "2", "TRAIN_DATA": data}, cwd=tmp_path)
    assert out.returncode == 2
    assert f"TRAIN_DATA={data}: the checkout's finetune_cogvlm_demo.py reads folders of <label>.jpg images" \
        in out.stderr

"""Bad input is refused early, with a message that says what to change.

One row per case: a function that builds the bad input under ``tmp_path`` and runs the check that
must refuse it (before any model is built), and the fragment the message must contain. Rows marked
with a patch name also run with that patch removed, and must then NOT give the message.
"""
import builtins
import json
import os
import warnings

import pytest
import torch

import sat_patches
from patching import patches_removed


# ----------------------------------------------------------------------------- inputs
def _checkpoint(root, shards=2, iteration=3, truncate=None):
    os.makedirs(root / str(iteration))
    for i in range(shards):
        f = root / str(iteration) / f"mp_rank_{i:02d}_model_states.pt"
        torch.save({"module": {"w": torch.zeros(4)}}, f)
        if i == truncate:
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2])
    (root / "latest").write_text(str(iteration))
    (root / "model_config.json").write_text(json.dumps({"num_layers": 2, "hidden_size": 64,
                                                        "num_attention_heads": 4, "vocab_size": 1024}))
    return str(root)


def _images(folder, good=2, bad=0):
    from PIL import Image
    folder.mkdir()
    for i in range(good):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(folder / f"ok{i}_ab12.jpg")
    for i in range(bad):
        (folder / f"bad{i}_cd34.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    return str(folder)


def _dataset(path):
    from sat_patches.cogvlm.dataset import ItemDataset
    return ItemDataset(None, None, None, path)


# ----------------------------------------------------------------------------- cases
def mp_not_dividing_world(tmp):
    from sat_patches.runner.finetune_check import check
    raise ValueError("\n".join(check({"CPU_RANKS": "3", "MP_SIZE": "2"})))


def mp_not_dividing_heads(tmp):
    from sat_patches.runner.finetune_check import check
    raise ValueError("\n".join(check({"CPU_RANKS": "3", "MP_SIZE": "3", "MODEL_TYPE": "cogvlm-base-490"})))


def checkpoint_missing(tmp):
    from sat_patches.checkpoints.loading import find_checkpoint
    find_checkpoint(str(tmp / "nowhere"))


def checkpoint_empty(tmp):
    from sat_patches.checkpoints.loading import find_checkpoint
    (tmp / "empty").mkdir()
    find_checkpoint(str(tmp / "empty"))


def checkpoint_missing_shard(tmp):
    from sat_patches.checkpoints.loading import find_checkpoint
    root = _checkpoint(tmp / "ck")
    os.remove(os.path.join(root, "3", "mp_rank_01_model_states.pt"))
    (tmp / "ck" / "3" / "mp_rank_02_model_states.pt").write_bytes(b"")   # shard 1 of 3 missing
    find_checkpoint(root)


def checkpoint_truncated(tmp):
    from sat_patches.checkpoints.loading import find_checkpoint
    find_checkpoint(_checkpoint(tmp / "ck", truncate=1))


def model_config_missing_fields(tmp):
    from sat_patches.checkpoints.loading import read_model_config
    root = _checkpoint(tmp / "ck")
    (tmp / "ck" / "model_config.json").write_text('{"num_layers": 2, "vocab_size": 1024}')
    read_model_config(root)


def _model_config(tmp, **changes):
    from sat_patches.checkpoints.loading import read_model_config
    root = _checkpoint(tmp / "ck")
    config = json.loads((tmp / "ck" / "model_config.json").read_text())
    (tmp / "ck" / "model_config.json").write_text(json.dumps(dict(config, **changes)))
    read_model_config(root)


def model_config_negative_layers(tmp):
    _model_config(tmp, num_layers=-2)


def model_config_absurd_hidden_size(tmp):
    _model_config(tmp, hidden_size=10 ** 12)


def model_config_size_as_text(tmp):
    _model_config(tmp, vocab_size="32000")


def model_config_heads_not_dividing(tmp):
    _model_config(tmp, num_attention_heads=5)


def model_config_eva_args_not_a_mapping(tmp):
    _model_config(tmp, eva_args=["EVA2CLIPModel", 63])


def model_config_eva_args_bad_size(tmp):
    _model_config(tmp, eva_args={"num_layers": 0, "hidden_size": 1792, "num_attention_heads": 16, "vocab_size": 1})


def model_config_not_an_object(tmp):
    from sat_patches.checkpoints.loading import read_model_config
    root = _checkpoint(tmp / "ck")
    (tmp / "ck" / "model_config.json").write_text("[32, 4096]")
    read_model_config(root)


def dataset_empty(tmp):
    _dataset(_images(tmp / "data", good=0))


def dataset_all_unreadable(tmp):
    _dataset(_images(tmp / "data", good=0, bad=3))


def dataset_some_unreadable(tmp):
    _dataset(_images(tmp / "data", good=2, bad=1))  # refused by default (SAT_PATCHES_BAD_RECORDS=refuse)


def lora_rank_zero(tmp):
    from sat.model.finetune.lora2 import LoraMixin
    LoraMixin(4, 0)


def lora_rank_negative(tmp):
    from sat.model.finetune.lora2 import LoraMixin
    LoraMixin(4, -2, layer_range=[0, 1])


def lora_layer_range_out_of_bounds(tmp):
    from sat.model.finetune.lora2 import LoraMixin
    LoraMixin(4, 8, layer_range=[0, 4, 7])


def lora_layer_range_vs_checkpoint(tmp):
    """The demo-side check, before from_pretrained: num_layers from the checkpoint's model_config.json."""
    import argparse
    from sat_patches.runtime.checks import check_finetune_args
    check_finetune_args(argparse.Namespace(use_lora=True, lora_rank=8, layer_range=[0, 16], use_qlora=False,
                                           from_pretrained=_checkpoint(tmp / "ck")))


def qlora_without_bitsandbytes(tmp):
    from sat.model.finetune.lora2 import LoraMixin
    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError(f"No module named '{name}' (simulated)")
        return real_import(name, *args, **kwargs)
    builtins.__import__ = no_bnb
    try:
        LoraMixin(4, 8, qlora=True)
    finally:
        builtins.__import__ = real_import


def deepspeed_config_not_json(tmp):
    import sat
    path = tmp / "ds.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 1,\n  "zero_optimization": {"stage": 2,},\n}\n')
    sat.get_args(["--mode", "finetune", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                  "--vocab-size", "1024", "--deepspeed_config", str(path)])


def load_timeout_not_a_number(tmp):
    from sat_patches.core.coordination import load_timeout
    saved = os.environ.get("SAT_PATCHES_LOAD_TIMEOUT")
    os.environ["SAT_PATCHES_LOAD_TIMEOUT"] = "30min"
    try:
        load_timeout()
    finally:
        if saved is None:
            del os.environ["SAT_PATCHES_LOAD_TIMEOUT"]
        else:
            os.environ["SAT_PATCHES_LOAD_TIMEOUT"] = saved


def sat_code_differs(tmp):
    """An SAT whose save_checkpoint no longer looks as verified: the patch is skipped with a warning."""
    import sat.training.model_io as model_io

    def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):  # a different SAT's code
        return None
    with patches_removed("atomic_checkpoint_save"):
        original = model_io.save_checkpoint
        model_io.save_checkpoint = save_checkpoint
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sat_patches.REGISTRY.get("atomic_checkpoint_save").apply()
            raise ValueError("; ".join(str(w.message) for w in caught))
        finally:
            model_io.save_checkpoint = original


#  case function, expected fragment, patch without which the message must not appear
CASES = [
    (mp_not_dividing_world, "MP_SIZE=2 does not divide the world size 3", None),
    (mp_not_dividing_heads, "MP_SIZE=3 does not divide the 32 attention heads", None),
    (checkpoint_missing, "does not exist: pass the directory", None),
    (checkpoint_empty, "is empty: the download or copy did not finish", None),
    (checkpoint_missing_shard, "lacks model-parallel shard(s) [1]", None),
    (checkpoint_truncated, "is truncated or not a torch checkpoint", None),
    (model_config_missing_fields, "lacks hidden_size, num_attention_heads: add them", None),
    (model_config_negative_layers, "num_layers is -2; it must be a whole number from 1 to 4096", None),
    (model_config_absurd_hidden_size, "hidden_size is 1000000000000; it must be a whole number from 1 to 131072", None),
    (model_config_size_as_text, "vocab_size is '32000'; it must be a whole number", None),
    (model_config_heads_not_dividing, "num_attention_heads 5 does not divide hidden_size 64", None),
    (model_config_eva_args_not_a_mapping, "eva_args is list, not a mapping of the vision tower's settings", None),
    (model_config_eva_args_bad_size, "model_config.json' eva_args: num_layers is 0", None),
    (model_config_not_an_object, "must be a JSON object, not list: fix or re-create it", None),
    (dataset_empty, "it holds no .jpg file", None),
    (dataset_all_unreadable, "3 image(s) of", None),
    (dataset_some_unreadable, "1 image(s) of", None),
    (lora_rank_zero, "LoRA rank 0 must be a positive integer: pass e.g. --lora_rank 8", "lora_args_check"),
    (lora_rank_negative, "LoRA rank -2 must be a positive integer", "lora_args_check"),
    (lora_layer_range_out_of_bounds, "layer(s) [4, 7] outside the model's 4 layers: use indices 0..3", "lora_args_check"),
    (lora_layer_range_vs_checkpoint, "layer(s) [16] outside the model's 2 layers", None),
    (qlora_without_bitsandbytes, "--use_qlora needs a working bitsandbytes", "lora_args_check"),
    (deepspeed_config_not_json, "ds.json' is not valid JSON: Expecting property name enclosed in double quotes at line 3",
     "deepspeed_config_json"),
    (load_timeout_not_a_number, "SAT_PATCHES_LOAD_TIMEOUT='30min': set it to a positive number of seconds (how long "
                                "ranks wait for each other while loading), e.g. SAT_PATCHES_LOAD_TIMEOUT=1800", None),
    (sat_code_differs, "skipping patch 'atomic_checkpoint_save'", None),
]


@pytest.mark.parametrize("case, fragment, patch", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_input_refused(case, fragment, patch, tmp_path):
    with pytest.raises(Exception) as info:
        case(tmp_path)
    assert fragment in str(info.value), str(info.value)
    if patch:
        with patches_removed(patch):
            try:
                (tmp_path / "stock").mkdir()
                case(tmp_path / "stock")
                message = ""
            except Exception as exc:  # noqa: BLE001  (stock SAT fails somewhere else, or not at all)
                message = str(exc)
        assert fragment not in message, f"stock SAT already says it: {message}"


def test_stock_sat_takes_zero_rank_to_zero_division():
    from sat.model.finetune.lora2 import LoraMixin
    with patches_removed("lora_args_check"):
        with pytest.raises(ZeroDivisionError):
            LoraMixin(4, 0)

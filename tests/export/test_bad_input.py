"""Bad input to export and import is refused with a message saying what to change, before anything is
written; nothing is unpickled except through the safe loader; an output folder appears whole or not at all."""
import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from sat_patches.checkpoints.files import CheckpointError
from sat_patches.checkpoints.safe_load import UnsafeCheckpointError
from sat_patches.cli.export import main
from sat_patches.export.hf import export_hf
from sat_patches.export.importer import import_hf
from sat_patches.export.source import SatCheckpoint

from .helpers import build, config_of, mp2_states, save


class Payload:
    """Stands for code a shared checkpoint could name: unpickling it would build this object."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    model, args = build("cogvlm")
    state, config = model.state_dict(), config_of(args)
    save(str(root / "sat"), state, config)
    export_hf(str(root / "sat"), str(root / "hf"), max_shard_bytes=10**6)
    return root, model, state, config


def refused(call, match, out, error=CheckpointError):
    with pytest.raises(error, match=match):
        call()
    assert not os.path.exists(out)
    parent = os.path.dirname(out)
    assert not [f for f in os.listdir(parent) if ".partial" in f or ".tmp-" in f]   # nothing staged left


def test_export_refuses_bad_checkpoints(tiny, tmp_path):
    root, model, state, config = tiny
    out = str(tmp_path / "out")
    refused(lambda: export_hf(str(tmp_path / "nowhere"), out), "does not exist", out)

    save(str(tmp_path / "llama"), state, dict(config, model_class="BaseModel"))
    refused(lambda: export_hf(str(tmp_path / "llama"), out), "is not CogVLM or CogAgent", out)

    save(str(tmp_path / "wide"), state, dict(config, hidden_size=256))
    refused(lambda: export_hf(str(tmp_path / "wide"), out), "model_config.json and the checkpoint disagree", out)

    save(str(tmp_path / "deep"), state, dict(config, num_layers=3, max_sequence_length=512))
    refused(lambda: export_hf(str(tmp_path / "deep"), out), "lacks .* tensor", out)

    save(str(tmp_path / "extra"), dict(state, **{"mixins.ptuning.prefix": torch.zeros(3)}), config)
    refused(lambda: export_hf(str(tmp_path / "extra"), out), r"mixins\.ptuning\.prefix", out)

    save(str(tmp_path / "mp2"), None, config, mp2_states(model, state))
    os.remove(tmp_path / "mp2" / "1" / "mp_rank_01_model_states.pt")
    refused(lambda: export_hf(str(tmp_path / "mp2"), out), r"lacks model-parallel shard\(s\) \[1\]", out)


def test_export_never_unpickles_what_names_code(tiny, tmp_path):
    root, _, state, config = tiny
    save(str(tmp_path / "evil"), dict(state), config)
    path = tmp_path / "evil" / "1" / "mp_rank_00_model_states.pt"
    torch.save({"module": dict(state), "iteration": 1, "extra": Payload()}, str(path))
    out = str(tmp_path / "out")
    refused(lambda: export_hf(str(tmp_path / "evil"), out), "could run code", out, UnsafeCheckpointError)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["hf", str(tmp_path / "evil"), out]) == 1
    assert err.getvalue().startswith("error: ") and "Payload" in err.getvalue()


def test_existing_output_is_kept_and_a_failed_export_leaves_nothing(tiny, tmp_path, monkeypatch):
    root, *_ = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["hf", str(root / "sat"), str(out)]) == 1
    assert "exists; choose a new output folder or pass --overwrite" in err.getvalue()
    assert os.listdir(out) == ["mine.txt"]

    calls = []

    def failing(self, name):
        calls.append(name)
        if len(calls) == 20:
            raise OSError("No space left on device")
        return original(self, name)
    original = SatCheckpoint.tensor
    monkeypatch.setattr(SatCheckpoint, "tensor", failing)
    with pytest.raises(OSError, match="No space left"):
        export_hf(str(root / "sat"), str(out), overwrite=True, max_shard_bytes=10**5)
    assert os.listdir(out) == ["mine.txt"]                           # the old folder, untouched
    assert sorted(os.listdir(tmp_path)) == ["out"]                   # no staging folder left
    monkeypatch.undo()
    out_text = io.StringIO()
    with contextlib.redirect_stdout(out_text):
        assert main(["hf", str(root / "sat"), str(out), "--overwrite"]) == 0
    assert "exported CogVLMModel" in out_text.getvalue() and "config.json" in os.listdir(out)


def copy_hf(root, tmp_path, name="hf"):
    dst = tmp_path / name
    shutil.copytree(root / "hf", dst)
    return dst


def test_import_refuses_bad_folders(tiny, tmp_path):
    root, *_ = tiny
    out = str(tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(lambda: import_hf(str(empty), out), "config.json.* not found", out)

    other = copy_hf(root, tmp_path, "llama")
    config = json.load(open(other / "config.json"))
    json.dump(dict(config, architectures=["LlamaForCausalLM"]), open(other / "config.json", "w"))
    refused(lambda: import_hf(str(other), out), "not CogVLM or CogAgent", out)

    wide = copy_hf(root, tmp_path, "wide")
    json.dump(dict(config, hidden_size=256), open(wide / "config.json", "w"))
    refused(lambda: import_hf(str(wide), out), "config.json and the weights disagree", out)

    missing = copy_hf(root, tmp_path, "missing")
    index = json.load(open(missing / "model.safetensors.index.json"))
    lost = sorted(set(index["weight_map"].values()))[1]
    os.remove(missing / lost)
    refused(lambda: import_hf(str(missing), out), f"lacks shard\\(s\\) {lost}", out)

    truncated = copy_hf(root, tmp_path, "truncated")
    with open(truncated / lost, "r+b") as f:
        f.truncate(os.path.getsize(truncated / lost) // 2)
    refused(lambda: import_hf(str(truncated), out), "is truncated", out)

    extra = copy_hf(root, tmp_path, "extra")
    index = json.load(open(extra / "model.safetensors.index.json"))
    from safetensors.torch import save_file
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, str(extra / "more.safetensors"))
    index["weight_map"]["model.layers.0.self_attn.q_proj.weight"] = "more.safetensors"
    json.dump(index, open(extra / "model.safetensors.index.json", "w"))
    refused(lambda: import_hf(str(extra), out), r"q_proj", out)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(root / "hf" / "config.json", pickled)
    torch.save({"x": Payload()}, str(pickled / "pytorch_model.bin"))
    refused(lambda: import_hf(str(pickled), out), "pickled weights are not read", out)

    refused(lambda: import_hf(str(root / "hf"), out, mp=3), "cannot be split over 3", out)


def test_command_lines(tiny, tmp_path):
    from sat_patches.cli.export import import_main
    from sat_patches.cli.main import main as sat_patches_command
    root, *_ = tiny
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert sat_patches_command(["import", "hf", str(root / "hf"), str(tmp_path / "sat"), "--mp", "2"]) == 0
        assert main(["hf", str(tmp_path / "sat"), str(tmp_path / "hf"), "--max-shard-size", "0.5"]) == 0
    text = out.getvalue()
    assert "at model-parallel size 2" in text and "from 2 model-parallel shard(s)" in text
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["peft", str(root / "sat"), str(tmp_path / "peft")]) == 1
        assert import_main(["gguf", "x", "y"]) == 2
    assert "holds no LoRA matrices" in err.getvalue() and "usage: sat-patches import hf" in err.getvalue()


def test_import_without_rotary_buffers_computes_sats(tiny, tmp_path):
    """A folder saved without the layers' rotary ``inv_freq`` (a non-persistent buffer there) still imports:
    SAT's own buffer is computed, equal to what SAT built the model with."""
    from safetensors.torch import load_file, save_file
    root, model, state, _ = tiny
    folder = copy_hf(root, tmp_path, "norotary")
    index = json.load(open(folder / "model.safetensors.index.json"))
    for file in set(index["weight_map"].values()):
        tensors = {k: v for k, v in load_file(str(folder / file)).items() if "rotary_emb" not in k}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "rotary_emb" not in k}
    json.dump(index, open(folder / "model.safetensors.index.json", "w"))
    import_hf(str(folder), str(tmp_path / "sat"))
    from .helpers import assert_identical, load_module
    assert_identical(load_module(str(tmp_path / "sat"))[0], state)


def test_adapter_on_an_unmerged_base_is_refused(tmp_path):
    from .helpers import save_adapter_only
    model, args = build("cogvlm", lora_rank=2)
    state, config = model.state_dict(), config_of(args)
    base = save(str(tmp_path / "base"), state, config)            # a LoRA save used as a base, not merged
    adapter = save_adapter_only(str(tmp_path / "run"), state, config, base)
    out = str(tmp_path / "out")
    refused(lambda: export_hf(adapter, out), "holds LoRA matrices.*merge the base first", out)


def test_a_config_the_model_cannot_be_built_from_is_refused(tiny, tmp_path):
    root, _, state, config = tiny
    save(str(tmp_path / "odd"), state, dict(config, image_length=15))   # not the EVA grid (16 patches)
    out = str(tmp_path / "out")
    refused(lambda: export_hf(str(tmp_path / "odd"), out), "cannot be built from .*model_config.json", out)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["hf", str(tmp_path / "odd"), out]) == 1
    assert "image_length" in err.getvalue()

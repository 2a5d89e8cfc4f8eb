"""Adapter-only saves of a LoRA run: the standalone CogVLM at MP=2 on 2 CPU ranks saves its adapters (a few
per cent of a full save) and names its base; loaded onto that base they give the full save's logits, they merge
to MP=1 as the full save does, and a different base is refused with both fingerprints."""
import os
import shutil

import pytest
import torch

from multirank import run_ranks
from sat_patches.runner import finetune_run




def _argv(tiny, save):
    env = finetune_run.settings({"MODEL_KIND": "cogvlm", "CPU_RANKS": "2", "MP_SIZE": "2", "TRAIN_ITERS": "2",
                                 "SAVE_INTERVAL": "2", "LOG_INTERVAL": "1", "CUDA_VISIBLE_DEVICES": ""})
    options = finetune_run.train_options(env, model=tiny.model_dir, tokenizer=tiny.tokenizer_dir,
                                         train=tiny.train_jsonl, valid=tiny.valid_jsonl, save=save,
                                         ds_config=finetune_run.config_path("cpu_demo.json"))
    return ["--kind", "cogvlm", *options]


def train_both_and_compare(tiny, root):
    """(each rank) The same training saved adapter-only and whole; both loaded back at MP=2: logits."""
    import glob
    from sat_patches.cogvlm import evaluation, standalone
    from sat_patches.cogvlm import create_dataset_function, data_collator, llama2_tokenizer
    runs = {}
    for name, value in (("adapter", "1"), ("full", "0")):
        os.environ["SAT_PATCHES_SAVE_ADAPTER_ONLY"] = value
        assert standalone.train(_argv(tiny, os.path.join(root, name))) == 0
        (runs[name],) = glob.glob(os.path.join(root, name, "finetune-*"))
    logits = {}
    for name, run in runs.items():
        model, args = evaluation.load_for_generation(run, "cogvlm", mp=2)
        args.max_length = 120
        image, text, cross = standalone.processors(args, llama2_tokenizer(tiny.tokenizer_dir))
        batch = data_collator([create_dataset_function(image, text, cross, tiny.valid_jsonl, args)[0]])
        with torch.no_grad():
            logits[name] = model(**standalone.model_inputs(batch))[0]
    return {"runs": runs, "same_logits": torch.equal(logits["adapter"], logits["full"])}


def merge_both_and_refuse_another_base(tiny, runs, other_base):
    """(one rank) Both runs merged to MP=1; the adapter onto a base that differs."""
    from sat_patches.checkpoints import merge
    from sat_patches.cogvlm import evaluation
    from sat_patches.checkpoints.adapter import AdapterError
    from sat_patches.checkpoints.files import find_checkpoint
    merged = {}
    for name, run in runs.items():
        out = run + "-merged"
        merge.merge(run, out)
        merged[name] = find_checkpoint(out).open(0)["module"]
    same = merged["adapter"].keys() == merged["full"].keys() and all(
        torch.equal(merged["adapter"][k], merged["full"][k]) for k in merged["full"])
    manifest = os.path.join(find_checkpoint(runs["adapter"]).files[0].rsplit("/", 1)[0], "adapter.json")
    with open(manifest) as f:
        text = f.read()
    with open(manifest, "w") as f:
        f.write(text.replace(os.path.abspath(tiny.model_dir), other_base))
    try:
        evaluation.load_for_generation(runs["adapter"], "cogvlm", mp=1)
        refused = None
    except AdapterError as exc:
        refused = str(exc)
    return {"same_merge": same, "refused": refused}


@pytest.mark.slow
@pytest.mark.multirank
def test_an_adapter_only_save_is_small_and_reloads_merges_and_checks_its_base(tmp_path):
    from sat_patches.checkpoints.files import find_checkpoint
    from sat_patches.cogvlm import prepare_tiny_run
    tiny = prepare_tiny_run(str(tmp_path / "tiny"), "cogvlm", n_train=4, n_valid=1)
    results = run_ranks(train_both_and_compare, 2, args=(tiny, str(tmp_path)), timeout=300,
                        env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    for r in results:
        assert r.result is not None, (r.exception or "") + r.output[-4000:]
        assert r.result["same_logits"]
    runs = results[0].result["runs"]
    adapter, full = (find_checkpoint(runs[n]) for n in ("adapter", "full"))
    assert adapter.mp_size == full.mp_size == 2
    for small, whole in zip(adapter.files, full.files):
        assert os.path.getsize(small) < 0.05 * os.path.getsize(whole), (os.path.getsize(small), os.path.getsize(whole))
        keys = adapter.open(0)["module"].keys()
        assert any("matrix_A" in k for k in keys)  # besides LoRA, only a buffer (the rotary frequencies)
        assert [k for k in keys if "matrix_A" not in k and "matrix_B" not in k] == ["mixins.rotary.rotary_emb.inv_freq"]
    # another base: same architecture, one weight changed
    other = str(tmp_path / "other-base")
    shutil.copytree(tiny.model_dir, other)
    [shard] = find_checkpoint(other).files
    saved = torch.load(shard, weights_only=False)
    first = next(k for k in saved["module"] if k.endswith("query_key_value.weight"))
    saved["module"][first] = saved["module"][first] + 1
    torch.save(saved, shard)
    [r] = run_ranks(merge_both_and_refuse_another_base, 1, args=(tiny, runs, other), timeout=300)
    assert r.result is not None, (r.exception or "") + r.output[-4000:]
    assert r.result["same_merge"]
    refused = r.result["refused"]
    assert refused and f"was trained on {other}" in refused and f"but that folder now holds {other}" in refused
    assert refused.count("sha256") == 2 and "load the adapter's own base" in refused


@pytest.mark.parametrize("setting, base, trains, expected, warns", [
    ("", True, ["matrix_A"], True, False),
    ("", False, ["matrix_A"], False, False),           # nothing to name as the base
    ("", True, ["matrix_A", "mlp"], False, False),     # something besides LoRA trains: it must be saved
    ("1", True, [], False, True),                      # LoRA merged into the base: the whole model
    ("1", True, ["matrix_A", "mlp"], False, True),
    ("0", True, ["matrix_A"], False, False),
])
def test_a_save_holds_adapters_only_when_nothing_else_trains(monkeypatch, setting, base, trains, expected, warns):
    import warnings
    from sat_patches.checkpoints import adapter
    module = torch.nn.Module()
    for name in ("matrix_A", "mlp"):
        module.register_parameter(name, torch.nn.Parameter(torch.zeros(2), requires_grad=name in trains))
    if base:
        setattr(module, adapter.BASE_ATTRIBUTE, {"sha256": "x"})
    monkeypatch.setenv(adapter.SETTING, setting)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert adapter.adapter_only(module) is expected
    assert bool([w for w in seen if "holds the whole model" in str(w.message)]) is warns

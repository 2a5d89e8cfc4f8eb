"""The plan's checkpointing reaches the run: the finetune scripts' options (SAT's ``--checkpoint-skip-layers``
beside the plan's micro-batch) and the standalone trainer's EVA tower (the same share of its layers)."""
import argparse

import pytest

from sat_patches.planning import search, shapes
from sat_patches.runner import finetune_run, sizing


def _gpu_options(monkeypatch, tmp_path, memory_gb, **environ):
    monkeypatch.setattr(sizing, "gpu_memory_gb", lambda: memory_gb)
    env = finetune_run.settings(dict({"NUM_GPUS_PER_WORKER": "1", "CUDA_VISIBLE_DEVICES": "0",
                                      "SAVE_DIR": str(tmp_path)}, **environ))
    return env, finetune_run.train_options(env)


def _skip(opts):
    return int(opts[opts.index("--checkpoint-skip-layers") + 1]) if "--checkpoint-skip-layers" in opts else 0


@pytest.mark.parametrize("memory_gb, global_batch", [(80, ""), (141, "8")])
def test_the_scripts_pass_the_plans_skip_beside_its_micro_batch(monkeypatch, tmp_path, memory_gb, global_batch):
    env, opts = _gpu_options(monkeypatch, tmp_path, memory_gb, GLOBAL_BATCH=global_batch)
    config = shapes.resolve_model("cogvlm-base-490")
    best = search.recommend([o for o in search.options(config, 1, memory_gb, seq_len=1288, zero=2, offload=False,
                                                       qlora=False, global_batch=int(global_batch or 4))
                             if o.estimate.setup.mp == 1]).estimate.setup
    assert best.checkpoint_skip_layers > 0
    assert "--checkpoint-activations" in opts and "--vit_checkpoint_activations" in opts
    assert _skip(opts) == best.checkpoint_skip_layers
    ds = opts[opts.index("--deepspeed_config") + 1]
    assert ds.endswith(f".global_batch{best.global_batch}.micro_batch{best.micro_batch}"
                       f".accumulation{best.accumulation}.json")


def test_the_users_skip_wins_and_checkpoint_activations_0_turns_it_all_off(monkeypatch, tmp_path):
    _, opts = _gpu_options(monkeypatch, tmp_path, 80, CHECKPOINT_SKIP_LAYERS="3")
    assert _skip(opts) == 3
    _, opts = _gpu_options(monkeypatch, tmp_path, 80, CHECKPOINT_SKIP_LAYERS="0")
    assert "--checkpoint-activations" in opts and "--checkpoint-skip-layers" not in opts
    _, opts = _gpu_options(monkeypatch, tmp_path, 80, CHECKPOINT_ACTIVATIONS="0")
    assert "--checkpoint-activations" not in opts and "--checkpoint-skip-layers" not in opts


@pytest.mark.parametrize("why", ["no memory figure", "unknown model"])
def test_where_the_plan_cannot_tell_every_layer_is_checkpointed(monkeypatch, tmp_path, why):
    memory, environ = (None, {}) if why == "no memory figure" else (80, {"MODEL_TYPE": str(tmp_path / "mine")})
    env, opts = _gpu_options(monkeypatch, tmp_path, memory, **environ)
    assert sizing.planned(env, sizing.read_config("zero2.json"), 4)[0] is None
    assert "--checkpoint-activations" in opts and "--checkpoint-skip-layers" not in opts


def test_the_standalone_trainer_leaves_the_same_share_of_evas_layers_out():
    from sat_patches.cogvlm.image_mixin import vision_args
    from sat_patches.cogvlm.standalone import demo_parser
    eva = shapes.MODELS["cogvlm-base-490"]["eva_args"]
    args = argparse.Namespace(mode="finetune", num_layers=32, vit_checkpoint_activations=True, checkpoint_skip_layers=8)
    assert vision_args(args, eva).checkpoint_skip_layers == 15            # a quarter of 63, rounded down
    assert vision_args(argparse.Namespace(**vars(args), vit_checkpoint_skip_layers=40), eva).checkpoint_skip_layers == 40
    assert vision_args(argparse.Namespace(mode="finetune", num_layers=32), eva).checkpoint_skip_layers == 0
    known, _ = demo_parser("cogvlm").parse_known_args(["--vit_checkpoint_skip_layers", "7"])
    assert known.vit_checkpoint_skip_layers == 7

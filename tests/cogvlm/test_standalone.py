"""The standalone CogVLM trainer (``python -m sat_patches finetune``): QLoRA as upstream's demo does it."""

import pytest

from multirank import run_ranks
from sat_patches.runner import finetune_run


def train_and_inspect(argv):
    """Run ``standalone.train(argv)`` and describe the model it trained."""
    import sat.training.deepspeed_training as dt
    from sat_patches.cogvlm import standalone
    trained = {}
    original = dt.training_main

    def training_main(args, model_cls, *a, **kw):
        trained["model"] = original(args, model_cls, *a, **kw)
        return trained["model"]

    dt.training_main = training_main
    try:
        assert standalone.train(argv) == 0
    finally:
        dt.training_main = original
    module = getattr(trained["model"], "module", trained["model"])
    lora = {n: p for n, p in module.named_parameters() if "matrix_" in n}
    bases = {type(m.original).__name__ for n, m in module.named_modules() if type(m).__name__ == "LoraLinear"}
    return {
        "bases": sorted(bases),
        "lora_in_eva": any(n.startswith("mixins.eva") for n in lora),
        "lora_trained": sum(float(p.detach().float().abs().sum()) for n, p in lora.items() if "matrix_B" in n) > 0,
        "trainable": sorted({next((f for f in ("matrix_A", "matrix_B") if f in n), n)
                             for n, p in module.named_parameters() if p.requires_grad}),
    }


@pytest.mark.slow  # a QLoRA run end to end (over 10 s)
@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "data-parallel-2"])
def test_use_qlora_trains_adapters_on_an_nf4_base(tmp_path, ranks):
    """QLoRA at MP=1, on one rank and on two data-parallel ranks (each its own NF4 base, ZeRO over the adapters)."""
    from sat_patches.cogvlm import prepare_tiny_run
    run = prepare_tiny_run(str(tmp_path / "run"), "cogvlm", n_train=8, n_valid=2)
    env = finetune_run.settings({"MODEL_KIND": "cogvlm", "CPU_RANKS": str(ranks), "MP_SIZE": "1", "TRAIN_ITERS": "3",
                                 "LOG_INTERVAL": "1", "CUDA_VISIBLE_DEVICES": ""})
    options = finetune_run.train_options(env, model=run.model_dir, tokenizer=run.tokenizer_dir, train=run.train_dir,
                                         valid=run.valid_dir, save=str(tmp_path / "checkpoints"),
                                         ds_config=finetune_run.config_path("cpu_demo.json"))
    argv = ["--kind", "cogvlm", *[o for o in options if o != "--use_lora"], "--use_qlora"]
    results = run_ranks(train_and_inspect, ranks, args=(argv,), timeout=300, env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    for r in results:
        assert r.result is not None, (r.exception or "") + r.output[-4000:]
        assert r.result["bases"] == ["LinearNF4"]  # every LoRA layer wraps a 4-bit base
        assert not r.result["lora_in_eva"]         # upstream's QLoRA: language model only
        assert r.result["lora_trained"] and r.result["trainable"] == ["matrix_A", "matrix_B"]

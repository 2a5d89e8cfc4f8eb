"""Selective checkpointing in the plan: its memory and time per layer, the search over its share of the checkpointed
layers, the table's rows naming each state's share and the layers' path, and the setting that realises it (the
layers the runtime makes selective are the ones the plan counted)."""
from dataclasses import replace

import pytest

from sat_patches.planning import memory, realise, search, shapes, timing
from sat_patches.runtime.checkpointing import SETTING

CONFIG = shapes.resolve_model("cogvlm-base-490")
AGENT = shapes.resolve_model("cogagent-chat")


def _setup(**fields):
    return memory.Setup(micro_batch=4, seq_len=shapes.default_seq_len(CONFIG), **fields)


@pytest.mark.parametrize("config", [CONFIG, AGENT], ids=["cogvlm", "cogagent"])
def test_a_selective_layer_recomputes_no_matrix_product_and_keeps_more_than_a_full_one(config):
    full, half = _setup(), _setup(selective_share=0.5)
    layers = config["num_layers"]
    passes = timing.forward_passes(config, full.seq_len)
    saved = timing.step_time(config, full, 989).recomputed_flop - timing.step_time(config, half, 989).recomputed_flop
    eva = config["eva_args"]["num_layers"]
    expected = full.micro_batch * (layers // 2 * passes.language_layer + (eva + 1) // 2 * passes.eva_layer)
    assert saved == pytest.approx(expected)
    assert timing.step_time(config, half, 989).seconds < timing.step_time(config, full, 989).seconds
    lang = "activations (language)"
    assert memory.estimate(config, full).device[lang] < memory.estimate(config, half).device[lang] \
        < memory.estimate(config, _setup(checkpoint_activations=False)).device[lang]


def test_the_search_fills_the_memory_left_with_selective_layers_only_when_asked():
    plain = search.options(CONFIG, 1, 48, selective=False)
    assert {o.estimate.setup.selective_share for o in plain} == {0.0}
    asked = search.options(CONFIG, 1, 48, selective=True)
    chosen = [o for o in asked if o.estimate.setup.selective_share]
    assert chosen and all(o.viable for o in chosen)
    for o in chosen:  # as many as fit: one more selective layer would not
        s = o.estimate.setup
        checkpointed = CONFIG["num_layers"] - s.checkpoint_skip_layers
        n = timing.selective_layers(checkpointed, s.selective_share)
        if n < checkpointed:
            more = replace(s, selective_share=(n + 1) / checkpointed)
            assert memory.estimate(CONFIG, more).per_gpu > 48 * memory.GB * (1 - search.GPU_MARGIN)
    best = search.recommend(asked)
    assert best.estimate.setup.selective_share and best.time.tokens_per_s > search.recommend(plain).time.tokens_per_s
    pinned = search.options(CONFIG, 1, 48, selective=0.5)
    assert {o.estimate.setup.selective_share for o in pinned if o.estimate.setup.checkpoint_activations} == {0.5}


def test_a_card_where_the_ladder_measured_a_lever_faster_gets_it_by_default(monkeypatch):
    monkeypatch.setitem(timing.MEASURED_FASTER, "selective", frozenset({"l40s"}))
    assert any(o.estimate.setup.selective_share for o in search.options(CONFIG, 1, 48))
    assert not any(o.estimate.setup.selective_share for o in search.options(CONFIG, 1, 80))    # an h100
    monkeypatch.setitem(timing.MEASURED_FASTER, "compiled", frozenset({"h100"}))
    assert all(o.estimate.setup.compiled for o in search.options(AGENT, 2, 80))


def test_the_setting_makes_selective_the_layers_the_plan_counted():
    from sat_patches.core import settings
    for skip in (0, 5, 20):
        checkpointed = CONFIG["num_layers"] - skip
        for n in range(checkpointed + 1):
            s = _setup(checkpoint_skip_layers=skip, selective_share=n / checkpointed if n else 0.0)
            value = realise.lever_settings(s).get(SETTING, "")
            share = settings.read(SETTING, {SETTING: value})
            states = timing.layer_states(CONFIG["num_layers"], skip, share)
            assert states.count("selective") == n == timing.selective_counts(CONFIG, s)[0], (skip, n, value)
    assert realise.lever_settings(_setup(compiled=True)) == {"SAT_PATCHES_COMPILE_LAYERS": "1"}
    assert realise.script_settings(_setup(selective_share=0.25))[SETTING] == "0.25"


def test_rows_name_each_states_share_of_the_layers_and_the_layers_path(capsys):
    from sat_patches.cli.main import main
    from sat_patches.cli.plan import checkpointing, layer_path
    assert checkpointing(_setup(checkpoint_skip_layers=8, selective_share=0.5), 32) == "full 38% selective 38% none 25%"
    assert checkpointing(_setup(checkpoint_activations=False), 32) == "none 100%"
    assert layer_path(_setup()) == "eager" and layer_path(_setup(compiled=True)) == "compiled"
    assert main(["plan", "--model", "cogvlm-base-490", "--gpus", "1", "--gpu-mem", "48", "--selective"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.endswith("  ok")]
    assert any(" selective " in row for row in rows) and all(" eager " in row for row in rows)
    assert "checkpointing full" in out and "eager layers" in out


def test_the_scripts_pass_the_plans_levers_to_the_ranks_under_the_users_own(monkeypatch, tmp_path):
    from sat_patches.runner import finetune_run, sizing
    monkeypatch.setattr(sizing, "gpu_memory_gb", lambda: 36)    # QLoRA fills what an NF4 base leaves
    monkeypatch.setitem(timing.MEASURED_FASTER, "selective", frozenset({"a100-40gb"}))
    seen = []
    monkeypatch.setattr(finetune_run.steps, "run", lambda commands, env, cwd=None, dry_run=False: seen.append(env) or 0)
    base = {"MODEL_KIND": "cogvlm", "NUM_GPUS_PER_WORKER": "1", "MP_SIZE": "1", "CUDA_VISIBLE_DEVICES": "0",
            "QLORA": "1", "SAVE_DIR": str(tmp_path), "DRY_RUN": "1"}
    for key in (SETTING, "CHECKPOINT_SKIP_LAYERS", "MICRO_BATCH", "GLOBAL_BATCH"):
        monkeypatch.delenv(key, raising=False)
    for name, value in base.items():
        monkeypatch.setenv(name, value)
    assert finetune_run.main([]) == 0
    assert float(seen[-1][SETTING]) > 0
    monkeypatch.setenv(SETTING, "0")
    assert finetune_run.main([]) == 0
    assert seen[-1][SETTING] == "0"

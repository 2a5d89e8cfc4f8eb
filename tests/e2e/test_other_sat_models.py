"""Other SAT models' LoRA fine-tunes (SAT's ChatGLM2 example, VisualGLM-6B's QLoRA), as their scripts run them.

The script (``other_sat_scripts``: a ``ChatGLM2Model`` subclass that adds LoRA or QLoRA in its constructor,
``from_pretrained(path, args)`` without ``overwrite_args``) starts from a released-style checkpoint saved at
model-parallel size 1:

* at ``--model-parallel-size 2`` it trains at MP=2 (each rank holds half the vocabulary rows) and its first loss
  is MP=1's; a size the model cannot be split into stops every rank with the reason;
* ``python -m sat_patches merge RUN OUT --import other_sat_scripts`` folds its LoRA (the class adds LoRA itself)
  and gives the trained model's logits;
* with ``--use_qlora`` it loads through the streamed NF4 loader (bitsandbytes' bits) and trains on 2
  data-parallel ranks;
* with ``--bf16`` SAT's evaluation report reaches TensorBoard.
"""
import math
import os

import other_sat_scripts as scripts
import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.multirank
slow = pytest.mark.slow  # SAT's ChatGLM2 trained on 2 CPU ranks (~35 s in all); the evaluation case is quick


def _train(argv, nranks, patches=True):
    results = run_ranks(scripts.main, nranks, args=(argv,), timeout=240, patches=patches)
    return results


def _ok(results):
    for r in results:
        assert r.result is not None, (r.exception or "") + r.output[-3000:]
    return [r.result for r in results]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return scripts.write_base(str(tmp_path_factory.mktemp("chatglm2") / "base"))


@pytest.fixture(scope="module")
def mp2_run(base, tmp_path_factory):
    """The script at --model-parallel-size 2 from the MP=1 checkpoint, saving its last iteration."""
    save = str(tmp_path_factory.mktemp("runs"))
    results = _train(["--from_pretrained", base, "--model-parallel-size", "2", "--save", save,
                      "--save-interval", "3"], 2)
    return results, save


@slow
def test_an_mp1_checkpoint_trains_at_the_asked_mp2_with_mp1_first_loss(base, mp2_run):
    results, _ = mp2_run
    mp2 = _ok(results)
    mp1 = _ok(_train(["--from_pretrained", base, "--model-parallel-size", "1"], 1))[0]
    assert mp1["mp"] == 1 and mp1["embedding_rows"] == 1024
    for got in mp2:
        assert got["mp"] == 2 and got["embedding_rows"] == 512, got  # each rank holds half of the split weight
        assert got["loss"] == pytest.approx(mp1["loss"], abs=1e-5), (got["loss"], mp1["loss"])
    assert "model-parallel size 2; '" in results[0].output and "saved at model-parallel size 1 (split on load)" \
        in results[0].output, results[0].output[-3000:]


@slow
def test_a_size_the_model_cannot_split_into_stops_every_rank_with_the_reason(tmp_path):
    base = scripts.write_base(str(tmp_path / "base"), num_attention_heads=2, num_multi_query_heads=1)
    results = _train(["--from_pretrained", base, "--model-parallel-size", "2"], 2)
    for r in results:
        assert r.result is None and r.exception, r.output[-3000:]
        assert "model-parallel size 2 cannot be used" in r.exception, r.exception
        assert "num_multi_query_heads 1 does not split into 2" in r.exception, r.exception


@slow
def test_merge_with_import_of_a_class_that_adds_lora_itself_gives_the_trained_logits(mp2_run, tmp_path):
    from sat.model.official.chatglm2_model import ChatGLM2Model

    from sat_patches.cli import merge
    results, save = mp2_run
    trained = torch.tensor(_ok(results)[0]["logits"])
    run = os.path.join(save, os.listdir(save)[0])
    out = str(tmp_path / "merged")
    assert merge.main([run, out, "--import", "other_sat_scripts"]) == 0
    model, _ = ChatGLM2Model.from_pretrained(out, None, overwrite_args={"model_parallel_size": 1})
    assert not any("matrix_" in k for k in model.state_dict())
    merged = scripts.logits(model)
    assert merged.shape == trained.shape
    assert (merged - trained).abs().max() <= 1e-4 * trained.abs().max(), (merged - trained).abs().max()


@slow
def test_qlora_in_the_constructor_loads_as_nf4_with_bitsandbytes_bits(base, monkeypatch):
    import bitsandbytes.functional as bnbf

    from sat_patches.checkpoints import loading
    from sat_patches.lora import layer as lora
    from sat_patches.lora import qlora
    built = []
    real_meta, real_get = loading._build_on_meta, loading.get_model
    monkeypatch.setattr(loading, "_build_on_meta", lambda *a: built.append(True) or real_meta(*a))
    monkeypatch.setattr(loading, "get_model", lambda *a, **kw: built.append(False) or real_get(*a, **kw))
    cls = scripts.FineTuneChatGLM2
    args = cls.get_args(**scripts.CONFIG, use_qlora=True, lora_rank=4, device="cpu")
    model, _ = cls.from_pretrained(base, args, overwrite_args={"model_parallel_size": 1})
    assert built == [True]  # built on meta, each linear quantised as its weights arrived
    qkv = model.transformer.layers[0].attention.query_key_value
    assert lora.is_lora_layer(qkv) and lora._is_nf4(qkv.original)
    linears = [m for root in qlora.qlora_base(model) for m in root.modules() if isinstance(m, qlora.FLOAT_LINEARS)]
    assert linears and all(lora._is_nf4(m) for m in linears), linears  # every linear of the transformer and its mixins is NF4
    saved = torch.load(os.path.join(base, "1", "mp_rank_00_model_states.pt"), weights_only=True)["module"]
    want, _ = bnbf.quantize_4bit(saved["transformer.layers.0.attention.query_key_value.weight"], blocksize=64,
                                 compress_statistics=True, quant_type="nf4")
    assert torch.equal(qkv.original.weight.data.reshape(-1), want.reshape(-1))


@slow
def test_qlora_in_the_constructor_trains_on_two_data_parallel_ranks(base):
    got = _ok(_train(["--from_pretrained", base, "--model-parallel-size", "1", "--use_qlora"], 2))
    for rank in got:
        assert rank["mp"] == 1 and rank["nf4"] == ["LinearNF4"], rank
        assert len(rank["losses"]) == 3 and all(math.isfinite(x) for x in rank["losses"]), rank


BF16_EVAL = ["--model-parallel-size", "1", "--bf16", "--zero-stage", "1", "--valid-data", "synthetic",
             "--eval-interval", "2", "--eval-iters", "1", "--eval-batch-size", "4"]


@slow
@pytest.mark.parametrize("patched", [True, False])
def test_a_bf16_run_evaluates(base, tmp_path, patched):
    argv = ["--from_pretrained", base, "--summary-dir", str(tmp_path / "summary")] + BF16_EVAL
    results = _train(argv, 1, patches=True if patched else ["evaluation_metrics_float"])
    if patched:
        assert _ok(results)[0]["losses"], results[0].output[-3000:]
        assert "validation loss at iteration 2" in results[0].output, results[0].output[-3000:]
    else:  # SAT hands the bf16 metric to TensorBoard
        assert results[0].result is None and "BFloat16" in results[0].output, results[0].output[-3000:]


def test_evaluate_with_import_loads_a_class_that_adds_lora_itself(tmp_path):
    """``python -m sat_patches evaluate ... --import MODULE``: the run's own class, LoRA not added twice."""
    import json

    from sat.model.base_model import get_model

    from sat_patches.cogvlm import evaluation
    from sat_patches.cogvlm.saving import save_pretrained_dir
    from sat_patches.cogvlm.tiny import tiny_args
    args = tiny_args("cogvlm", lora_rank=4, seed=1234)
    args.model_class = "LoraCogVLM"
    model = get_model(args, scripts.LoraCogVLM)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "matrix_B" in name:
                p.uniform_(-0.1, 0.1)
    run = save_pretrained_dir(model, args, str(tmp_path / "run"))
    config_path = os.path.join(run, "model_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:  # a LoRA run's config, as the fork's training saves it
        json.dump(dict(config, use_lora=True, lora_rank=4), f)
    loaded, _ = evaluation.load_for_generation(run, "cogvlm", 1, imports=("other_sat_scripts",))
    assert type(loaded).__name__ == "LoraCogVLM"
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want) and any("matrix_B" in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)

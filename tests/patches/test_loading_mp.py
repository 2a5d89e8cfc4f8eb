"""Checkpoints at another model-parallel size load rank-locally, from mapped files.

Each rank builds the same MP=1 CogVLM-like model (LLaMA + vision experts, fused QKV with stride 3,
LoRA on every attention), rank 0 saves it as a SAT checkpoint, then every rank calls
``from_pretrained(..., overwrite_args={'model_parallel_size': 2})`` (and ``AutoModel``'s) and checks
its own partition against SAT's own ``partition()`` of the reference (LoRA A/B against
``sat_patches.patches.lora.split_lora_state_dict``), the MP=2 logits against the MP=1 logits, that no tensor
was sent between ranks, and that the caller's ``args``/``overwrite_args`` are untouched. Last, rank
0 hangs while loading: rank 1 must stop within ``SAT_PATCHES_LOAD_TIMEOUT`` naming rank 0's stage.
The stock run shows SAT's own path: rank 0 builds the full model and ships partitions.
"""
import pytest

from multirank import run_ranks

pytestmark = pytest.mark.multirank

CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024, inner_hidden_size=128,
           num_vision_layers=2)
SEQ = 8


def _reference(ckpt_dir, lora=False):
    """Every rank: the MP=1 reference model (same values everywhere, LoRA B != 0); rank 0 saves it."""
    import torch
    import torch.distributed as dist
    from sat import mpu
    import expert_llama as el
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1)
    cfg = el.config(**CFG, lora_rank=4 if lora else 0)
    args = el.build_args(cfg)
    ref = el.model_class()(args)
    el.fill_(ref, seed=0)
    if dist.get_rank() == 0:
        el.write_checkpoint(ref, cfg, ckpt_dir)
    dist.barrier()
    return ref, cfg


def _logits(model):
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (2, SEQ), generator=g)
    pos = torch.arange(SEQ)[None].expand_as(ids)
    vision = torch.zeros(2, SEQ, dtype=torch.bool)
    vision[:, :3] = True
    model.eval()  # no dropout
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, attention_mask=torch.ones(1, 1, SEQ, SEQ).tril(),
                     vision_mask=vision)[0].float()


def _expected(ref, mp, rank):
    """Rank ``rank``'s MP=``mp`` state: SAT's own partition(), LoRA layers by sat_patches.patches.lora's split."""
    from sat.mpu import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from lora_state import split_lora_state_dict
    state = dict(ref.state_dict())
    for name, module in ref.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            weights, biases = module.partition(mp)
            state[name + ".weight"] = weights[rank]
            if biases:
                state[name + ".bias"] = biases[rank]
    state.update(split_lora_state_dict(ref.state_dict(), ref, mp)[rank])
    return state


def _diff(model, want):
    """(max |difference|, names whose shape differs) of a model's state against ``want``."""
    worst, mismatched = 0.0, []
    for name, t in model.state_dict().items():
        if want[name].shape != t.shape:
            mismatched.append(name)
        else:
            worst = max(worst, float((want[name].float() - t.float()).abs().max()))
    return worst, mismatched


def load_mp2(ckpt_dir, cuda_standin=False, lora=False, stall_timeout=None):
    """MP=1 checkpoint -> MP=2 with from_pretrained (and AutoModel's); returns what the tests check.

    ``cuda_standin``: ``Tensor.cuda()`` returns the tensor, so that stock SAT's rank-0 path (which
    calls it before ``send``) runs on CPU as it does on a GPU machine. ``lora``: the model has LoRA
    on every attention (A/B split between ranks as sat_patches.patches.lora lays them out).
    ``stall_timeout``: then load once more with ``SAT_PATCHES_LOAD_TIMEOUT`` at that many seconds
    while rank 0 hangs in ``torch.load`` (see :func:`stalled_load`)."""
    import copy
    import torch
    import torch.distributed as dist
    from sat import mpu
    import expert_llama as el
    if cuda_standin:
        torch.Tensor.cuda = lambda self, *a, **kw: self

    from sat.model.base_model import AutoModel
    ref, cfg = _reference(ckpt_dir, lora)
    ref_logits = _logits(ref)
    sent = []
    for op in ("send", "recv", "isend", "irecv", "broadcast", "scatter"):
        real = getattr(dist, op)

        def counting(tensor, *a, _op=op, _real=real, **kw):
            sent.append((_op, tuple(tensor.shape) if tensor is not None else None))
            return _real(tensor, *a, **kw)
        setattr(dist, op, counting)

    mpu.destroy_model_parallel()  # as a training script started with --model-parallel-size 2 has it
    mpu.initialize_model_parallel(2)
    caller_args = el.build_args(cfg, mode="inference", skip_init=False, model_parallel_size=2)
    before = copy.deepcopy(vars(caller_args))
    overwrite = {"model_parallel_size": 2}
    out = {"rank": dist.get_rank()}
    try:
        model, args = el.model_class().from_pretrained(ckpt_dir, caller_args, overwrite_args=overwrite)
    except Exception as exc:  # stock SAT on CPU: .cuda() before send
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["sent"] = [s for s in sent if s[1] and len(s[1]) > 1]  # weights, not size messages
    out["args_changed"] = sorted(k for k in set(before) | set(vars(caller_args))
                                 if before.get(k, "<absent>") != vars(caller_args).get(k, "<absent>"))
    out["overwrite_after"] = overwrite
    out["mp"] = mpu.get_model_parallel_world_size()
    want = _expected(ref, 2, mpu.get_model_parallel_rank())
    out["param_diff"], out["mismatched"] = _diff(model, want)
    out["lora_keys"] = sum("matrix_" in k for k in model.state_dict())
    out["devices"] = sorted({str(p.device) for p in model.parameters()})
    out["logit_diff"] = float((_logits(model) - ref_logits).abs().max())
    del sent[:]
    auto, _ = AutoModel.from_pretrained(ckpt_dir, el.build_args(cfg, mode="inference", model_parallel_size=2),
                                        overwrite_args={"model_parallel_size": 2})
    out["auto_sent"] = [s for s in sent if s[1] and len(s[1]) > 1]
    out["auto_diff"] = _diff(auto, want)
    if stall_timeout:
        out["stall"] = stalled_load(ckpt_dir, cfg, stall_timeout)
    return out


STALL_TIMEOUT = 3


@pytest.mark.slow
def test_mp1_checkpoint_loads_at_mp2_rank_locally(tmp_path):
    """... then rank 0 stalls in torch.load: rank 1 stops within the load timeout, naming the stage."""
    results = run_ranks(load_mp2, 2, args=(str(tmp_path / "ckpt"), False, True, STALL_TIMEOUT), timeout=150)
    for r in results:
        assert r.ok, r.output[-3000:]
        got = r.result
        assert "error" not in got, got
        assert got["mp"] == 2 and got["lora_keys"] == 2 * 2 * 4, got  # 2 layers, qkv (3 A, 3 B) + dense (1, 1)
        assert got["mismatched"] == [] and got["param_diff"] == 0.0, got
        assert got["logit_diff"] < 1e-5, got
        assert got["sent"] == [] and got["auto_sent"] == [], f"weights were sent between ranks: {got}"
        assert got["args_changed"] == [] and got["overwrite_after"] == {"model_parallel_size": 2}, got
        assert got["auto_diff"] == (0.0, []), got
    kind, elapsed, message = results[1].result["stall"]
    assert kind == "LoadTimeout", results[1].result["stall"]
    assert STALL_TIMEOUT <= elapsed < STALL_TIMEOUT + 5, elapsed
    assert "rank 0 is at stage 'opening 1 shard(s) of" in message and "SAT_PATCHES_LOAD_TIMEOUT" in message, message


@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
def test_stock_from_pretrained_ships_weights_and_mutates_args(tmp_path):
    """Without the patch (``Tensor.cuda`` stood in, as on a GPU box): rank 0 builds the full model and
    sends each partition; the caller's args and overwrite_args are changed."""
    results = run_ranks(load_mp2, 2, args=(str(tmp_path / "ckpt"), True), timeout=150,
                        patches=["from_pretrained_rank_local", "automodel_from_pretrained_rank_local"])
    rank0 = results[0].result
    assert rank0 is not None and "error" not in rank0, results[0].output[-3000:]
    assert rank0["sent"] and rank0["auto_sent"], rank0  # weights shipped from rank 0
    assert {"device", "skip_init"} <= set(rank0["args_changed"]), rank0
    assert rank0["overwrite_after"] == {}, rank0  # model_parallel_size popped from the caller's dict


def stalled_load(ckpt_dir, cfg, timeout):
    """Rank 0 hangs in torch.load for longer than the load timeout: the others must stop at the
    barrier, naming rank 0's stage. Returns (exception name or "loaded", seconds, message)."""
    import os
    import time
    import torch
    from sat import mpu
    import expert_llama as el
    os.environ["SAT_PATCHES_LOAD_TIMEOUT"] = str(timeout)
    if mpu.get_model_parallel_rank() == 0:
        real_load = torch.load

        def slow_load(*a, **kw):
            time.sleep(timeout + 4)
            return real_load(*a, **kw)
        torch.load = slow_load
    start = time.monotonic()
    try:
        el.model_class().from_pretrained(ckpt_dir, el.build_args(cfg, model_parallel_size=2),
                                         overwrite_args={"model_parallel_size": 2})
        return ("loaded", time.monotonic() - start, "")
    except Exception as exc:
        return (type(exc).__name__, time.monotonic() - start, str(exc))

"""LoRA under model parallelism: with the same weights, MP=2 equals MP=1 (2 gloo ranks, fp32).

One run per case; every rank first computes the MP=1 reference (MP=1 x DP=2), then the MP=2 model
loaded from the reference's state dict (LoRA layers through ``split_lora_state_dict``, the rest
through SAT's own ``partition()``), its LoRA gradients gathered back with
``merge_lora_state_dicts``, and finally the output after ``merge_lora``.
"""
import pytest

from sat_patches.testing import run_ranks

pytestmark = pytest.mark.multirank

TOL = 1e-5
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 1024, 64, 4, 2, 8


def _build(mp: int, rank_lora: int = 4, alpha: float = 8.0):
    from sat.model.base_model import BaseModel
    from sat.model.finetune.lora2 import LoraMixin
    args = BaseModel.get_args(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                              vocab_size=VOCAB, max_sequence_length=32, hidden_dropout=0.,
                              attention_dropout=0., model_parallel_size=mp)
    model = BaseModel(args)
    model.add_mixin("lora", LoraMixin(LAYERS, rank_lora, lora_alpha=alpha), reinit=True)
    return model


def _step(model, batch):
    """Logits and the LoRA gradients of a cross-entropy loss."""
    import torch
    ids, targets = batch
    pos = torch.arange(SEQ)[None].expand_as(ids)
    mask = torch.ones(1, 1, SEQ, SEQ).tril()
    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask)[0]
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "matrix_" in n}
    return logits.detach(), grads


def _shard_for(full, state_dict, layout, mp, rank):
    """The MP=``mp`` state dict of ``rank``: LoRA layers by our helper, the rest by SAT's partition()."""
    from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from sat_patches.lora import split_lora_state_dict
    shard = split_lora_state_dict(state_dict, layout, mp)[rank]
    helper_vs_sat = 0.0
    for name, module in full.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            weights, biases = module.partition(mp)
            key = name + ".weight"
            if key in shard:  # the base layer of a LoRA layer: our split must equal SAT's
                helper_vs_sat = max(helper_vs_sat, float((shard[key] - weights[rank]).abs().max()))
                if biases:
                    helper_vs_sat = max(helper_vs_sat, float((shard[name + ".bias"] - biases[rank]).abs().max()))
            shard[key] = weights[rank]
            if biases:
                shard[name + ".bias"] = biases[rank]
    for key, value in state_dict.items():
        shard.setdefault(key, value)
    return shard, helper_vs_sat


def _compare():
    """max |MP=2 - MP=1| of logits, LoRA gradients, and logits after merge_lora."""
    import torch
    import torch.distributed as dist
    from sat import mpu
    from sat_patches.lora import COLUMN, ROW, lora_layout, merge_lora_state_dicts

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g))

    mpu.initialize_model_parallel(1)
    torch.manual_seed(0)
    ref = _build(mp=1)
    with torch.no_grad():  # B != 0, or LoRA contributes nothing
        for name, p in ref.named_parameters():
            if "matrix_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ref_logits, ref_grads = _step(ref, batch)
    state_dict, layout = ref.state_dict(), lora_layout(ref)

    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2)
    rank = mpu.get_model_parallel_rank()
    model = _build(mp=2)
    shard, helper_vs_sat = _shard_for(ref, state_dict, layout, 2, rank)
    model.load_state_dict(shard, strict=True)
    logits, grads = _step(model, batch)

    gathered = [None, None]
    dist.all_gather_object(gathered, grads, group=mpu.get_model_parallel_group())
    full_grads = merge_lora_state_dicts(gathered, layout)
    replicated = [k for k in grads if (layout[k.rsplit(".", 2)[0]].kind, k.rsplit(".", 2)[1])
                  in {(COLUMN, "matrix_A"), (ROW, "matrix_B")}]

    model.get_mixin("lora").merge_lora()
    merged_logits, _ = _step(model, batch)
    mpu.destroy_model_parallel()
    layer = model.transformer.layers[0].attention
    return {
        "forward": float((logits - ref_logits).abs().max()),
        "grads": max(float((full_grads[k] - ref_grads[k]).abs().max()) for k in ref_grads),
        "grad_scale": max(float(v.abs().max()) for v in ref_grads.values()),
        "replicated_grads_agree": max(float((gathered[0][k] - gathered[1][k]).abs().max()) for k in replicated),
        "merged": float((merged_logits - ref_logits).abs().max()),
        "merged_types": [type(layer.query_key_value).__name__, type(layer.dense).__name__],
        "helper_vs_sat_partition": helper_vs_sat,
    }


CASES = {"patched": (), "without lora_linear": ("lora_linear",), "without lora_merge": ("lora_merge",)}


def mp_equivalence():
    """Rank function: :func:`_compare` with every patch, then with each LoRA patch removed."""
    import torch.distributed as dist
    from sat_patches.testing import patches_removed
    dist.init_process_group("gloo")
    results = {}
    for case, removed in CASES.items():
        if removed:
            with patches_removed(*removed):
                results[case] = _compare()
        else:
            results[case] = _compare()
    return results


@pytest.fixture(scope="module")
def ranks():
    results = run_ranks(mp_equivalence, nranks=2, timeout=150)
    for r in results:
        assert r.ok, r.exception or r.output[-3000:]
    return [r.result for r in results]


def test_mp2_equals_mp1_forward_grads_and_merged(ranks):
    for res in (r["patched"] for r in ranks):
        assert res["helper_vs_sat_partition"] == 0.0
        assert res["forward"] < TOL, res
        assert res["grads"] < TOL, res
        assert res["replicated_grads_agree"] < TOL, res
        assert res["merged"] < TOL, res
        assert res["merged_types"] == ["ColumnParallelLinear", "RowParallelLinear"], res


def test_without_lora_linear_mp2_differs_from_mp1(ranks):
    """Stock LoraLinear: x @ A^T of RowParallel LoRA is never all-reduced."""
    for res in (r["without lora_linear"] for r in ranks):
        assert res["forward"] > 1e-2, res
        assert res["grads"] > 1e-3 * res["grad_scale"], res


def test_without_lora_merge_merged_model_differs(ranks):
    """Stock merge_linear_lora: a plain nn.Linear of the rank-local weight replaces the parallel layer."""
    for res in (r["without lora_merge"] for r in ranks):
        assert res["forward"] < TOL, res  # the LoRA layer itself is right ...
        assert res["merged"] > 1e-2, res  # ... its merge is not
        assert res["merged_types"] == ["Linear", "Linear"], res

"""LoRA under model parallelism: with the same weights, MP=2 equals MP=1 (2 gloo ranks, fp32).

Every rank first computes the MP=1 reference (MP=1 x DP=2), then the MP=2 model loaded from the
reference's state dict (LoRA layers through ``split_lora_state_dict``, the rest through SAT's own
``partition()``), its LoRA gradients gathered back with ``merge_lora_state_dicts``, and the output
after ``merge_lora``. One 2-rank run covers every case: all patches, then each LoRA patch removed.
"""
import pytest

from multirank import run_ranks
from test_lora import VOCAB, batch, build, logits, randomize_b

pytestmark = pytest.mark.multirank

TOL = 1e-5


def _step(model, ids):
    """Logits and the LoRA gradients of a next-token loss."""
    import torch
    model.zero_grad()
    out = logits(model, ids)
    torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "matrix_" in n}
    return out.detach(), grads


def _shard_for(full, state_dict, layout, mp, rank):
    """The MP=``mp`` state dict of ``rank``: LoRA layers by our helper, the rest by SAT's partition()."""
    from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from lora_state import split_lora_state_dict
    shard = split_lora_state_dict(state_dict, layout, mp)[rank]
    helper_vs_sat = 0.0
    for name, module in full.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            weights, biases = module.partition(mp)
            pairs = [(name + ".weight", weights[rank])] + ([(name + ".bias", biases[rank])] if biases else [])
            for key, value in pairs:
                if key in shard:  # the base layer of a LoRA layer: our split must equal SAT's
                    helper_vs_sat = max(helper_vs_sat, float((shard[key] - value).abs().max()))
                shard[key] = value
    for key, value in state_dict.items():
        shard.setdefault(key, value)
    return shard, helper_vs_sat


def _compare_models():
    """max |MP=2 - MP=1| of logits, LoRA gradients, and logits after merge_lora."""
    import torch
    import torch.distributed as dist
    from sat import mpu
    from sat_patches.lora.layer import COLUMN, ROW
    from lora_state import lora_layout, merge_lora_state_dicts

    ids = batch()
    mpu.initialize_model_parallel(1)
    torch.manual_seed(0)
    ref = build(lora_rank=4)
    randomize_b(ref)  # B != 0, or LoRA contributes nothing
    ref_logits, ref_grads = _step(ref, ids)
    state_dict, layout = ref.state_dict(), lora_layout(ref)

    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2)
    model = build(mp=2, lora_rank=4)
    shard, helper_vs_sat = _shard_for(ref, state_dict, layout, 2, mpu.get_model_parallel_rank())
    model.load_state_dict(shard, strict=True)
    out, grads = _step(model, ids)

    gathered = [None, None]
    dist.all_gather_object(gathered, grads, group=mpu.get_model_parallel_group())
    full_grads = merge_lora_state_dicts(gathered, layout)
    replicated = [k for k in grads if (layout[k.rsplit(".", 2)[0]].kind, k.rsplit(".", 2)[1])
                  in {(COLUMN, "matrix_A"), (ROW, "matrix_B")}]

    model.get_mixin("lora").merge_lora()
    merged, _ = _step(model, ids)
    mpu.destroy_model_parallel()
    attn = model.transformer.layers[0].attention
    return {
        "forward": float((out - ref_logits).abs().max()),
        "grads": max(float((full_grads[k] - ref_grads[k]).abs().max()) for k in ref_grads),
        "grad_scale": max(float(v.abs().max()) for v in ref_grads.values()),
        "replicated_grads_agree": max(float((gathered[0][k] - gathered[1][k]).abs().max()) for k in replicated),
        "merged": float((merged - ref_logits).abs().max()),
        "merged_types": [type(attn.query_key_value).__name__, type(attn.dense).__name__],
        "helper_vs_sat_partition": helper_vs_sat,
    }


def _compare_layers():
    """Parallel layers SAT's attention does not use: ColumnParallel with gather_output=True and
    RowParallel with input_is_parallel=False. max |MP=2 - MP=1| of LoRA-layer outputs."""
    import torch
    from sat import mpu
    from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear
    from lora_state import lora_layout, split_lora_state_dict
    from sat.model.finetune.lora2 import replace_linear_with_lora

    def pair():
        torch.manual_seed(0)
        layers = torch.nn.ModuleDict({
            # stride 1: with stride > 1 SAT's gathered output is rank-major, not MP=1's layout
            "col": replace_linear_with_lora(ColumnParallelLinear(32, 48, gather_output=True), 1, 4, 8.),
            "row": replace_linear_with_lora(RowParallelLinear(48, 32, input_is_parallel=False), 1, 4, 8.)})
        randomize_b(layers)
        return layers

    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    mpu.initialize_model_parallel(1)
    ref = pair()
    ref_out = ref["row"](ref["col"](x))
    full = ref.state_dict()
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2)
    layers = pair()
    layers.load_state_dict(split_lora_state_dict(full, lora_layout(ref), 2)[mpu.get_model_parallel_rank()], strict=True)
    out = layers["row"](layers["col"](x))
    mpu.destroy_model_parallel()
    return float((out - ref_out).abs().max())


CASES = {"patched": (), "without lora_linear": ("lora_linear",), "without lora_merge": ("lora_merge",)}


def mp_equivalence():
    """Rank function: every case of :data:`CASES`."""
    import contextlib
    import torch.distributed as dist
    from patching import patches_removed
    dist.init_process_group("gloo")
    results = {}
    for case, removed in CASES.items():
        with patches_removed(*removed) if removed else contextlib.nullcontext():
            results[case] = _compare_models()
    results["patched"]["layers"] = _compare_layers()
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


def test_mp2_equals_mp1_for_gathered_column_and_scattered_row_layers(ranks):
    for res in (r["patched"] for r in ranks):
        assert res["layers"] < TOL, res


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

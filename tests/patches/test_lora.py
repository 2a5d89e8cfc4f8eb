"""LoRA patches in one process (MP=1): by reference, devices, bounded temporaries, checkpoints with
stock SAT, QLoRA, and the model-parallel split/merge helpers. Each patch's failure is shown by
running the same check with that patch removed (``patches_removed``)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import sat_patches
from sat_patches.runtime import devices
import lora_state
from sat_patches.lora import layer as lora_layer, qlora
from patching import patches_removed

LORA_PATCHES = ("lora_linear", "lora_replace", "lora_merge", "lora_reinit")
VOCAB, SEQ = 1024, 8


def build(num_layers=2, hidden=64, mp=1, dtype=torch.float32, llama=False, lora_rank=None, qlora=False, **arch):
    """A tiny SAT BaseModel (or LLaMAModel); with ``lora_rank``, LoraMixin(alpha=2*rank) added."""
    from sat.model.base_model import BaseModel
    from sat.model.official.llama_model import LLaMAModel
    cls = LLaMAModel if llama else BaseModel
    args = cls.get_args(num_layers=num_layers, hidden_size=hidden, num_attention_heads=4, vocab_size=VOCAB,
                        max_sequence_length=32, hidden_dropout=0., attention_dropout=0.,
                        model_parallel_size=mp, **arch)
    model = cls(args, params_dtype=dtype)
    if lora_rank:
        add_lora(model, lora_rank, qlora=qlora)
    return model


def add_lora(model, rank=4, qlora=False):
    from sat.model.finetune.lora2 import LoraMixin
    n = len(model.transformer.layers)
    model.add_mixin("lora", LoraMixin(n, rank, lora_alpha=2 * rank, qlora=qlora), reinit=True)
    return model


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if "matrix_" in n}


@torch.no_grad()
def randomize_b(model, seed=1, std=0.2):
    g = torch.Generator().manual_seed(seed)
    for name, p in lora_params(model).items():
        if "matrix_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * std)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def logits(model, ids):
    pos = torch.arange(SEQ)[None].expand_as(ids)
    return model(input_ids=ids, position_ids=pos, attention_mask=torch.ones(1, 1, SEQ, SEQ).tril())[0]


def test_lora_patches_applied():
    rows = {r["name"]: r for r in sat_patches.status()}
    assert all(rows[n]["status"] == "applied" for n in LORA_PATCHES), [rows[n] for n in LORA_PATCHES]


# -- by reference, device/dtype, init, flags ----------------------------------------------

def _wrap():
    torch.manual_seed(0)
    model = build(hidden=256, dtype=torch.bfloat16)
    attn = model.transformer.layers[0].attention
    qkv, dense = attn.query_key_value, attn.dense
    qkv_weight, ptr = qkv.weight, qkv.weight.data_ptr()
    add_lora(model)
    return model, attn, qkv, dense, qkv_weight, ptr


def test_lora_keeps_the_base_layer_by_reference():
    model, attn, qkv, dense, qkv_weight, ptr = _wrap()
    assert attn.query_key_value.original is qkv and attn.dense.original is dense
    assert attn.query_key_value.original.weight is qkv_weight and qkv_weight.data_ptr() == ptr
    for p in lora_params(model).values():
        assert (p.dtype, p.device.type) == (torch.bfloat16, "cpu")
    with patches_removed("lora_linear"):  # stock: a new base layer holding a copy
        _, attn, qkv, _, qkv_weight, ptr = _wrap()
        assert attn.query_key_value.original is not qkv
        assert attn.query_key_value.original.weight.data_ptr() != ptr


def test_lora_init_is_kaiming_uniform_a_sqrt5_and_zero_b():
    torch.manual_seed(0)
    model = build(num_layers=4, hidden=256, lora_rank=8)
    a = torch.cat([p.flatten() for n, p in lora_params(model).items() if "matrix_A" in n])
    bound = 1 / 256 ** 0.5  # kaiming_uniform_(a=sqrt(5)) of a (r, 256) matrix
    assert a.abs().max() <= bound and a.abs().max() > 0.99 * bound
    assert abs(a.std().item() - bound / 3 ** 0.5) < 0.03 * bound  # uniform's std
    assert all(not p.detach().any() for n, p in lora_params(model).items() if "matrix_B" in n)


def _split_flags():
    model = build(num_layers=1, lora_rank=4)
    attn = model.transformer.layers[0].attention
    return {(kind, name): {bool(getattr(p, "model_parallel", False)) for p in getattr(layer, name)}
            for kind, layer in (("column", attn.query_key_value), ("row", attn.dense))
            for name in ("matrix_A", "matrix_B")}


def test_model_parallel_flags_mark_exactly_the_split_factors():
    want = {("column", "matrix_A"): {False}, ("column", "matrix_B"): {True},
            ("row", "matrix_A"): {True}, ("row", "matrix_B"): {False}}
    assert _split_flags() == want
    model = build(num_layers=1, lora_rank=4)
    assert all(p.tensor_model_parallel == p.model_parallel for p in lora_params(model).values())
    with patches_removed("lora_linear"):  # stock: B always "split", A never
        assert _split_flags() != want


# -- the forward: one product for the A factors ---------------------------------------------

class Operations(TorchDispatchMode):
    """The aten operations dispatched inside, by name."""

    def __enter__(self):
        self.names = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _fused_qkv_lora(dtype=torch.float32):
    torch.manual_seed(0)
    model = build(num_layers=1, use_bias=False, lora_rank=4, dtype=dtype)
    randomize_b(model)
    return model.transformer.layers[0].attention.query_key_value


def _per_partition(layer, x):
    """Stock SAT's LoRA forward (one product per A and per B; the model-parallel maps are identities at one rank)."""
    lora = torch.cat([x @ a.t() @ b.t() for a, b in zip(layer.matrix_A, layer.matrix_B)], -1)
    return layer.original(x) + lora * layer.scaling


def test_a_fused_qkv_lora_multiplies_its_three_a_factors_in_one_product(monkeypatch):
    layer = _fused_qkv_lora()
    x = torch.randn(10, 64, requires_grad=True)
    with Operations() as ops:
        layer(x)
    assert ops.names.count("mm") == 1 + 1 + 3  # the base, the A factors together, each B

    def refuse(_):
        raise AssertionError("a model-parallel map at one rank (an identity autograd node, one view more)")
    monkeypatch.setattr(lora_layer.mappings, "copy_to_model_parallel_region", refuse)
    layer(x)


def test_one_product_for_the_a_factors_gives_the_per_partition_values_and_gradients(dtype=torch.float32):
    layer = _fused_qkv_lora(dtype)
    x = torch.randn(2, 10, 64, dtype=dtype)
    weight = torch.randn(2, 10, 192, dtype=dtype)
    results = []
    for forward in (layer, lambda t: _per_partition(layer, t)):
        leaf = x.clone().requires_grad_()
        out = forward(leaf)
        grads = torch.autograd.grad((out.float() * weight.float()).sum(), [leaf, *layer.matrix_A, *layer.matrix_B])
        results.append((out, grads))
    (out, grads), (plain_out, plain_grads) = results
    # the same up to the rounding of the products (a kernel may block a product of 3r columns unlike one of r),
    # and one rounding of the layer input's gradient from the A factors, not three summed
    torch.testing.assert_close(out, plain_out)
    for grad, plain in zip(grads, plain_grads):
        torch.testing.assert_close(grad, plain)


# -- meta base, bounded temporaries -----------------------------------------------------------

class Allocations(TorchDispatchMode):
    """Records the devices every aten op ran on, and the largest storage one allocated (outputs
    not aliasing an input)."""

    def __init__(self):
        super().__init__()
        self.largest, self.devices = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
                if t.device.type != "meta" and t.untyped_storage().data_ptr() not in inputs:
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _lora_devices(base, policy):
    """(devices of the LoRA params, devices any op ran on while injecting)."""
    model = build(num_layers=1).to(base)
    with devices.use_device(policy), Allocations() as ops:
        add_lora(model)
    return {p.device.type for p in lora_params(model).values()}, ops.devices


def test_lora_params_follow_the_base_weight_or_the_policy_while_it_is_on_meta():
    assert _lora_devices("meta", policy="meta") == ({"meta"}, {"meta"})  # not one CPU op
    assert _lora_devices("meta", policy="cpu")[0] == {"cpu"}  # LoRA params are in no base checkpoint
    assert _lora_devices("cpu", policy="meta")[0] == {"cpu"}  # beside a materialised base
    with patches_removed("lora_replace"):  # stock: new_layer.to(lin.weight.device) puts them on meta
        assert _lora_devices("meta", policy="cpu")[0] == {"meta"}
    # stock LoraLinear copies the base weight into a new CPU layer: impossible from meta (SAT's own
    # layers, without the construction context that moves their allocations to the policy device)
    construction = [p.name for p in sat_patches.patches.construction.PATCHES]
    with patches_removed("lora_linear", *construction):
        with pytest.raises(NotImplementedError, match="meta"):
            _lora_devices("meta", policy="meta")


CHUNK = 64 * 1024


def _largest_temporaries():
    torch.manual_seed(0)
    model = build(num_layers=1, hidden=256, dtype=torch.bfloat16)  # QKV weight: 384 KiB
    with Allocations() as inject:
        add_lora(model)
    largest_lora = max(p.untyped_storage().nbytes() for p in lora_params(model).values())
    randomize_b(model)
    with Allocations() as merge:
        model.get_mixin("lora").merge_lora()
    return inject.largest, largest_lora, merge.largest


def test_injection_and_merge_allocate_no_large_temporaries(monkeypatch):
    monkeypatch.setattr(lora_layer, "CHUNK_BYTES", CHUNK)
    inject, largest_lora, merge = _largest_temporaries()
    assert inject <= largest_lora  # only A and B themselves
    assert merge <= CHUNK
    with patches_removed("lora_linear"):  # stock: a new base layer plus a clone of the weight
        assert _largest_temporaries()[0] >= 384 * 1024
    with patches_removed("lora_merge"):  # stock: nn.Linear, full B @ A, weight + BA
        assert _largest_temporaries()[2] >= 384 * 1024


# -- merge keeps the parallel layer ---------------------------------------------------------

def _merge_report():
    torch.manual_seed(0)
    model = build(use_bias=False, lora_rank=4)
    randomize_b(model)
    attn = model.transformer.layers[0].attention
    bases = [attn.query_key_value.original, attn.dense.original]
    ids = batch()
    with torch.no_grad():
        before = logits(model, ids)
        model.get_mixin("lora").merge_lora()
        after = logits(model, ids)
    return bases, [attn.query_key_value, attn.dense], float((after - before).abs().max())


def test_merge_is_in_place_and_keeps_parallel_type_and_no_bias():
    from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear
    bases, merged, diff = _merge_report()
    assert merged[0] is bases[0] and merged[1] is bases[1]
    assert type(merged[0]) is ColumnParallelLinear and type(merged[1]) is RowParallelLinear
    assert merged[0].bias is None and merged[1].bias is None
    assert diff < 1e-5
    with patches_removed("lora_merge"):  # stock: a fresh plain nn.Linear
        _, merged, _ = _merge_report()
        assert type(merged[0]) is torch.nn.Linear


# -- checkpoints interchange with stock SAT ------------------------------------------------

def test_state_dicts_interchange_with_stock_sat_lora():
    torch.manual_seed(0)
    ours = build(lora_rank=4)
    randomize_b(ours, seed=3)
    with patches_removed(*LORA_PATCHES):
        torch.manual_seed(1)
        stock = build(lora_rank=4)
        randomize_b(stock, seed=4)
    ours_sd, stock_sd = ours.state_dict(), stock.state_dict()
    assert list(ours_sd) == list(stock_sd)
    assert "transformer.layers.0.attention.query_key_value.original.weight" in ours_sd
    assert "transformer.layers.0.attention.dense.matrix_B.0" in ours_sd

    fresh = build(lora_rank=4)
    assert not any(fresh.load_state_dict(stock_sd, strict=True))  # stock checkpoint -> ours
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in stock_sd.items())
    stock.load_state_dict(ours_sd, strict=True)  # ours -> stock
    assert all(torch.equal(stock.state_dict()[k], v) for k, v in ours_sd.items())


def test_plain_checkpoint_loads_into_lora_model_without_missing_keys():
    """SAT's load_checkpoint refuses missing keys outside mixins: a base checkpoint must load clean."""
    torch.manual_seed(0)
    plain_sd = build().state_dict()
    torch.manual_seed(1)
    model = build(lora_rank=4)
    result = model.load_state_dict(plain_sd, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    attn = model.transformer.layers[1].attention
    assert torch.equal(attn.dense.original.weight, plain_sd["transformer.layers.1.attention.dense.weight"])
    assert torch.equal(attn.query_key_value.original.bias,
                       plain_sd["transformer.layers.1.attention.query_key_value.bias"])


def test_plain_checkpoint_materialises_a_meta_base_lora_model_with_assign():
    """The meta-construction flow: base built on meta, LoRA added, base checkpoint loaded with assign."""
    torch.manual_seed(0)
    plain = build(num_layers=1)
    model = build(num_layers=1).to("meta")
    with devices.use_device("cpu"):
        add_lora(model)
    result = model.load_state_dict(plain.state_dict(), strict=False, assign=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    ids = batch()
    assert torch.equal(logits(model, ids), logits(plain, ids))  # B = 0


# -- QLoRA -------------------------------------------------------------------------------

def _qlora_inject():
    torch.manual_seed(0)
    return build(llama=True, use_bias=False, inner_hidden_size=128, lora_rank=4, qlora=True)


def _repack_for_cpu_inference(model):
    """What bitsandbytes' eval forward on CPU does to each NF4 weight on CPUs with AVX512-BF16 only
    (``Linear4bit.support_avx512bf16_for_cpu``): repack it into its CPU kernel's layout, in place. Done here
    by hand, so that reading such weights back (our merge, ``qlora.dequantize_nf4``) is tested on any CPU."""
    from bitsandbytes import functional as bnbf
    from bitsandbytes.nn import Linear4bit
    repacked = 0
    for layer in model.modules():
        if isinstance(layer, Linear4bit) and not getattr(layer.weight.quant_state, "packing_format_for_cpu", False):
            layer.weight.data, layer.weight.quant_state = bnbf._convert_weight_packed_for_cpu(
                layer.weight.data, layer.weight.quant_state)
            repacked += 1
    return repacked


@pytest.mark.parametrize("repacked", [False, True], ids=["as-quantised", "repacked-for-cpu-inference"])
def test_qlora_inject_train_step_and_merge(repacked):
    from bitsandbytes.nn import Linear4bit
    model = _qlora_inject()
    layer = model.transformer.layers[0]
    assert isinstance(layer.attention.dense.original, Linear4bit)
    assert layer.mlp.dense_h_to_4h.weight.dtype == torch.uint8  # quantised now, not at a later .cuda()

    for name, p in model.named_parameters():
        p.requires_grad_("matrix_" in name)
    trainable = list(lora_params(model).values())
    before = [p.detach().clone() for p in trainable]
    ids = batch()
    loss = torch.nn.functional.cross_entropy(logits(model, ids).reshape(-1, VOCAB), ids.reshape(-1))
    loss.backward()
    torch.optim.SGD(trainable, lr=1.0).step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainable))

    model.eval()
    dense = layer.attention.dense
    with torch.no_grad():
        unmerged = logits(model, ids)  # repacks NF4 weights on CPUs with AVX512-BF16 (bitsandbytes' inference path)
        if repacked:  # the other CPUs' branch, forced: the merge reads repacked weights
            packed_here = _repack_for_cpu_inference(model)
            assert packed_here or layer.attention.dense.original.support_avx512bf16_for_cpu
        expected = qlora.dequantize_nf4(dense.original) + dense.matrix_B[0] @ dense.matrix_A[0] * dense.scaling
        model.get_mixin("lora").merge_lora()
        merged = logits(model, ids)
    assert isinstance(layer.attention.dense, Linear4bit) and layer.attention.dense.bias is None
    err = (qlora.dequantize_nf4(layer.attention.dense) - expected).norm() / expected.norm()
    assert err < 0.15, err  # NF4 requantisation error only (~0.09); without the product ~0.8
    assert (merged - unmerged).abs().max() < 0.1 * unmerged.abs().max()


def test_qlora_fails_without_each_patch():
    with patches_removed("lora_linear"):
        with pytest.raises(NameError, match="dtype"):
            _qlora_inject()
    with patches_removed("lora_reinit"):  # stock: the MLP gets float, unquantised NF4 shells
        model = _qlora_inject()
        assert model.transformer.layers[0].mlp.dense_h_to_4h.weight.dtype != torch.uint8
    with patches_removed("lora_merge"):  # stock: assumes a bias
        model = _qlora_inject()
        with pytest.raises(AttributeError, match="data"):
            model.get_mixin("lora").merge_lora()


def test_qlora_on_a_meta_base_leaves_it_for_the_loader():
    """A model that adds QLoRA in its constructor is built on meta: its bases stay float on meta, and the
    streamed loader quantises each as its weights arrive (tests/e2e/test_other_sat_models.py)."""
    model = build(llama=True, use_bias=False, inner_hidden_size=128).to("meta")
    add_lora(model, qlora=True)
    qkv = model.transformer.layers[0].attention.query_key_value
    assert qkv.original.weight.is_meta and not lora_layer._is_nf4(qkv.original)
    assert model.transformer.layers[0].mlp.dense_h_to_4h.weight.is_meta


# -- model-parallel split / merge helpers -----------------------------------------------------

def test_split_and_merge_lora_state_dicts_round_trip_and_match_sat_partition():
    from sat.mpu.layers import ColumnParallelLinear
    torch.manual_seed(0)
    model = build(num_layers=1, lora_rank=4, num_multi_query_heads=2, hidden_size_per_attention_head=16)
    randomize_b(model)
    layout = lora_state.lora_layout(model)
    qkv = "transformer.layers.0.attention.query_key_value"
    assert layout[qkv] == ("column", [4, 2, 2]) and layout["transformer.layers.0.attention.dense"].kind == "row"
    sd = model.state_dict()
    shards = lora_state.split_lora_state_dict(sd, model, 2)
    assert set(shards[0]) == {k for k in sd if ".attention." in k}  # the LoRA layers' keys only
    merged = lora_state.merge_lora_state_dicts(shards, layout)
    assert set(merged) == set(shards[0]) and all(torch.equal(merged[k], sd[k]) for k in merged)

    base = model.transformer.layers[0].attention.query_key_value.original
    assert isinstance(base, ColumnParallelLinear)
    weights, biases = base.partition(2)  # SAT's own strided split of the base layer
    for rank in range(2):
        assert torch.equal(shards[rank][qkv + ".original.weight"], weights[rank])
        assert torch.equal(shards[rank][qkv + ".original.bias"], biases[rank])
        assert shards[rank][qkv + ".matrix_B.0"].shape == (32, 4)  # 4 query heads of 16 -> 2 per rank
        assert shards[rank][qkv + ".matrix_B.1"].shape == (16, 4)
    dense = "transformer.layers.0.attention.dense"
    assert shards[0][dense + ".matrix_A.0"].shape == (4, 32) and shards[0][dense + ".matrix_B.0"].shape == (64, 4)

    adapters_only = {k: v for k, v in sd.items() if "matrix_" in k}
    assert set(lora_state.split_lora_state_dict(adapters_only, layout, 2)[1]) == set(adapters_only)
    with pytest.raises(ValueError, match="quant_state"):
        lora_state.split_lora_state_dict({qkv + ".original.quant_state": torch.zeros(1)}, layout, 2)


def test_layout_reads_stock_lora_models_too():
    with patches_removed(*LORA_PATCHES):
        stock = build(num_layers=1, lora_rank=4)
    assert lora_state.lora_layout(stock) == lora_state.lora_layout(build(num_layers=1, lora_rank=4))

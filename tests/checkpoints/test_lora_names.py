"""LoRA's names are declared once (:mod:`sat_patches.checkpoints.lora_names`); every reader answers alike."""
import torch

from sat_patches.checkpoints import lora_names
from sat_patches.checkpoints.lora_names import FactorKey, factor_key, is_adapter, lora_layers


def test_a_factor_key_is_layer_factor_and_partition():
    assert factor_key("transformer.layers.0.attention.query_key_value.matrix_B.2") == FactorKey(
        "transformer.layers.0.attention.query_key_value", "matrix_B", 2)
    for not_a_factor in ("transformer.layers.0.attention.dense.original.weight", "x.matrix_C.0", "x.matrix_A",
                         "x.matrix_Abc.0", "x.matrix_A.weight"):
        assert factor_key(not_a_factor) is None, not_a_factor


def test_is_adapter_matches_whole_name_parts_only():
    assert is_adapter("mixins.eva.vit_model.transformer.layers.3.mlp.dense_h_to_4h.matrix_A.0")
    assert is_adapter("layers.0.attention.dense.matrix_B")
    assert not is_adapter("layers.0.attention.dense.original.weight")
    assert not is_adapter("mixins.matrix_Alpha.weight")  # a substring is not a LoRA factor


def test_lora_layers_counts_partitions_per_layer():
    keys = [f"a.qkv.matrix_{f}.{i}" for f in "AB" for i in range(3)] + ["a.dense.matrix_A.0", "a.dense.matrix_B.0",
                                                                        "a.dense.original.weight"]
    assert lora_layers(keys) == {"a.qkv": 3, "a.dense": 1}


def test_the_lora_layer_carries_the_declared_names():
    from sat_patches.lora.layer import LoraLinear, is_lora_layer
    layer = LoraLinear(None, 1, 8, 6, r=2, original_obj=torch.nn.Linear(8, 6))
    assert is_lora_layer(layer)
    names = [n for n, _ in layer.named_parameters()]
    assert {n for n in names if is_adapter(n)} == {"matrix_A.0", "matrix_B.0"}
    assert {n.split(".")[0] for n in names} == {lora_names.BASE, *lora_names.FACTORS}

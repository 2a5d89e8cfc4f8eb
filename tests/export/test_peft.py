"""peft loads the PEFT export of a LoRA run onto the exported model, and its merged weights equal SAT's merge
(fp32, <= 1e-6): SAT lora2's three (A, B) pairs on a fused qkv are one LoRA of rank 3r, scaling carried over."""
import json
import os

import pytest
import torch
from torch import nn

from sat_patches.export.hf import export_hf
from sat_patches.export.peft import export_peft
from sat_patches.export.source import ExportError

from .helpers import KINDS, base_state, build, config_of, folded, mp2_states, save, save_adapter_only
from .test_round_trip import hf_tensors



class Named(nn.Module):
    """A module tree with the exported folder's names: an ``nn.Linear`` for every 2-D ``*.weight`` (what
    LoRA targets), plain parameters for the rest (the HF CogVLM/CogAgent module paths)."""

    def __init__(self, tensors: dict):
        super().__init__()
        for name, t in sorted(tensors.items()):
            *path, leaf = name.split(".")
            parent = self
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            if leaf == "weight" and t.dim() == 2 and not isinstance(parent, nn.Linear) and not list(parent.children()):
                linear = nn.Linear(t.shape[1], t.shape[0], bias=False)
                for kept, p in parent.named_parameters(recurse=False):   # a bias registered before
                    linear.register_parameter(kept, p)
                owner = self.get_submodule(".".join(path[:-1])) if len(path) > 1 else self
                setattr(owner, path[-1], linear)
                parent = linear
            parent.register_parameter(leaf, nn.Parameter(t.clone(), requires_grad=False))

    def prepare_inputs_for_generation(self, *args, **kwargs):  # what peft's causal-LM wrapper reads
        return kwargs


@pytest.mark.parametrize("kind", [k if k == "cogvlm" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
@pytest.mark.parametrize("alpha", [1.0, 16.0])
def test_peft_merge_equals_sat_merge(kind, alpha, tmp_path):
    model, args = build(kind, lora_rank=2, seed=5)
    for _, m in model.named_modules():       # the run's lora_alpha (SAT: scaling = lora_alpha / r)
        if hasattr(m, "matrix_A"):
            m.lora_alpha, m.scaling = alpha, alpha / m.r
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = config_of(args)
    merged = folded(model)

    base = save(str(tmp_path / "base"), base_state(state), config)
    export_hf(base, str(tmp_path / "hf"))
    adapter = save_adapter_only(str(tmp_path / "run"), state, config, base)
    info = export_peft(adapter, str(tmp_path / "peft"), lora_alpha=alpha, base_model=str(tmp_path / "hf"))
    assert info["fused"] == (4 if kind == "cogagent" else 2)     # qkv per layer (+ cross key_value)
    adapter_config = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 2

    hf_base = Named(hf_tensors(str(tmp_path / "hf")))
    peft = pytest.importorskip("peft")  # here, not at collection: peft imports much of transformers (~5 s)
    wrapped = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "peft"))
    lora_layers = [n for n, m in wrapped.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(lora_layers) == info["layers"]
    result = wrapped.merge_and_unload().state_dict()

    # SAT's merge, in the exported names
    save(str(tmp_path / "merged"), merged, config)
    export_hf(str(tmp_path / "merged"), str(tmp_path / "hf_merged"))
    want = hf_tensors(str(tmp_path / "hf_merged"))
    assert set(result) == set(want)
    changed = 0
    for name, t in want.items():
        assert (result[name] - t).abs().max() <= 1e-6, name
        changed += not torch.equal(t, hf_tensors(str(tmp_path / "hf"))[name]) if name.endswith("query_key_value.weight") else 0
    assert changed > 0


def test_peft_export_from_mp2_equals_mp1_and_refuses_a_merged_checkpoint(tmp_path):
    from safetensors.torch import load_file
    model, args = build("cogvlm", lora_rank=2, seed=6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = config_of(args)
    save(str(tmp_path / "mp1"), state, config)
    save(str(tmp_path / "mp2"), None, config, mp2_states(model, state))
    export_peft(str(tmp_path / "mp1"), str(tmp_path / "p1"))
    export_peft(str(tmp_path / "mp2"), str(tmp_path / "p2"))
    one, two = (load_file(os.path.join(tmp_path, p, "adapter_model.safetensors")) for p in ("p1", "p2"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

    save(str(tmp_path / "plain"), base_state(state), config)
    with pytest.raises(ExportError, match="holds no LoRA matrices"):
        export_peft(str(tmp_path / "plain"), str(tmp_path / "p3"))
    assert not os.path.exists(tmp_path / "p3")

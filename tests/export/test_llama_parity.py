"""Text-only input (every token a language token): the exported language weights, loaded into transformers'
own ``LlamaForCausalLM``, give our SAT CogVLM's logits (fp32, <= 1e-4). CogVLM's language path is LLaMA's,
so this checks the qkv split, the rotary convention and the norms (epsilon from config.json) against a
library nobody here wrote."""
import json
import os

import pytest
import torch

from sat_patches.export.hf import export_hf

from .helpers import build, config_of, save
from .test_round_trip import hf_tensors

transformers = pytest.importorskip("transformers")


def llama_state(hf: dict, hidden: int) -> dict:
    """LlamaForCausalLM's names for the language-expert weights of an exported CogVLM folder: the fused
    qkv is [q|k|v] thirds (heads contiguous in each), everything else one to one."""
    out = {"model.embed_tokens.weight": hf["model.embed_tokens.weight"], "model.norm.weight": hf["model.norm.weight"],
           "lm_head.weight": hf["lm_head.weight"]}
    layers = {int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")}
    for i in layers:
        p = f"model.layers.{i}."
        q, k, v = hf[p + "self_attn.language_expert_query_key_value.weight"].split(hidden, dim=0)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": hf[p + "self_attn.language_expert_dense.weight"],
                    p + "input_layernorm.weight": hf[p + "input_layernorm.weight"],
                    p + "post_attention_layernorm.weight": hf[p + "post_attention_layernorm.weight"]})
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{proj}.weight"] = hf[p + f"mlp.language_mlp.{proj}.weight"]
    return out


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_llama_logits_equal_sat_cogvlm_text_only(tmp_path, eps):
    model, args = build("cogvlm", seed=3, **({} if eps is None else {"layernorm_epsilon": eps}))
    with torch.no_grad():  # weights far from SAT's small init, so that every part shows in the logits
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
    config = config_of(args)
    if eps is not None:  # a model trained with another epsilon (SAT built its norms with it)
        assert model.transformer.final_layernorm.variance_epsilon == eps
        config["layernorm_epsilon"] = eps
    save(str(tmp_path / "sat"), model.state_dict(), config)
    export_hf(str(tmp_path / "sat"), str(tmp_path / "hf"))
    hf_config = json.load(open(os.path.join(tmp_path, "hf", "config.json")))
    assert hf_config["rms_norm_eps"] == (1e-5 if eps is None else eps)   # SAT's default when the config has none

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=hf_config["vocab_size"], hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"], num_hidden_layers=hf_config["num_hidden_layers"],
        num_attention_heads=hf_config["num_attention_heads"], num_key_value_heads=hf_config["num_attention_heads"],
        rms_norm_eps=hf_config["rms_norm_eps"], max_position_embeddings=hf_config["max_position_embeddings"],
        hidden_act=hf_config["hidden_act"], tie_word_embeddings=False, attention_bias=False, mlp_bias=False))
    missing, unexpected = llama.load_state_dict(llama_state(hf_tensors(str(tmp_path / "hf")), args.hidden_size),
                                                strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    llama.eval()

    torch.manual_seed(1)
    ids = torch.randint(3, args.vocab_size, (2, 24))
    seq = ids.shape[1]
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=torch.arange(seq).expand(2, seq),
                     attention_mask=torch.ones(1, 1, seq, seq).tril())[0]
        theirs = llama(input_ids=ids).logits
    assert ours.abs().max() > 1.0                      # not a near-zero comparison
    assert (ours - theirs).abs().max() <= 1e-4, (ours - theirs).abs().max()

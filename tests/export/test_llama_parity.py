"""Text-only input (every token a language token): the exported language weights, loaded into transformers'
own ``LlamaForCausalLM``, give our SAT CogVLM's logits (fp32, <= 1e-4). CogVLM's language path is LLaMA's,
so this checks the qkv split, the rotary convention and the norms (epsilon from config.json) against a
library nobody here wrote."""
import json
import os

import pytest
import torch

from sat_patches.export.hf import export_hf
from exported_llama import llama_config_kwargs, llama_state_dict  # tests/support

from .helpers import build, config_of, save
from .test_round_trip import hf_tensors


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

    transformers = pytest.importorskip("transformers")  # here, not at collection
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_kwargs(hf_config)))
    missing, unexpected = llama.load_state_dict(llama_state_dict(hf_tensors(str(tmp_path / "hf")), args.hidden_size),
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

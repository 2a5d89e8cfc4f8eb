"""Part h of the GPU proof: the README's Hugging Face recipes on an export, one row per recipe.

The recipes (README, "Use your fine-tuned model elsewhere"), each on the ``sat-patches export hf`` folder of a
kit-made model, with the version set of ``sat_patches.hf_recipes`` (transformers 4.41.2, accelerate 0.30.1,
peft 0.11.1, bitsandbytes 0.50.2; prepare.sh's peer wheels carry the first three):

* bf16 load (``AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, torch_dtype=...)``), a
  forward whose logits equal SAT's on the same input, and a few generated tokens (``generate``, greedy, 3 new
  tokens; the first must be SAT's argmax);
* 4-bit load (``quantization_config=BitsAndBytesConfig(load_in_4bit=True)``) and a forward; logits beside the
  bf16 load's (quantised: cosine similarity >= 0.9, not equal);
* the PEFT adapter (``sat-patches export peft``, ``PeftModel.from_pretrained(base, adapter)``) on the exported
  base; logits beside SAT's with its LoRA.

The model: CogVLM of the kit's shapes (:func:`model_config`: ``proof_steps``' tiny CogVLM with ``--tiny``; on the
GPU the full-size widths, vocabulary and image size with 2 language and 2 EVA layers: the 17B model's base
checkpoint and its export, 35 GB each, would not both fit the machine's 64 GiB disk, and the recipes' logic does
not depend on the depth), random weights (std 0.02; at tiny size norms in [0.5, 1.5]), saved as a SAT checkpoint (the base), then LoRA r=10 on
the language model and EVA with random nonzero B factors (no training: a nonzero adapter is what the recipe must
carry), saved again (the run). ``export hf`` of the base with ``--hf-code`` (the remote code is copied into the
folder), ``export peft`` of the run. At full size everything is bf16 on the GPU; with ``--tiny`` (CPU) the loads
and SAT run in fp32, where equal means <= 1e-4 (the export tests' tolerance); in bf16 the logits are compared to
5e-2 of their largest magnitude. On the CPU a 4-bit load that transformers or bitsandbytes refuse is
``skipped: <their error>``.

Every recipe runs the released model's own remote code, which is not ours to ship: the part needs it as
``--hf-code DIR`` (as part p). Without it, or without transformers and peft, each recipe's row is
``skipped: <what is needed>``.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from proof_record import Recorder, Skip, cuda, device

RECIPES = ("bf16 load + a few generated tokens, logits beside SAT's",
           "4-bit load + a forward, logits beside the bf16 load's",
           "the PEFT adapter on the exported base, logits beside SAT's with LoRA")
EQUAL_FP32 = 1e-4            # fp32: as the export's round-trip tests (absolute)
EQUAL_BF16 = 5e-2            # bf16: relative to the largest logit
COSINE_4BIT = 0.9
NEW_TOKENS = 3
LAYERS = 2                   # language and EVA layers of the model on the GPU


def why_skipped(hf_code) -> str:
    """Why the recipes cannot run here (empty when they can): what part p's peer needs (the remote code,
    transformers and peft)."""
    from proof_peer import missing
    return missing(hf_code)


def model_config(tiny: bool) -> dict:
    """The SAT config of the model the recipes run on (the module's docstring says why it is shallow on the GPU)."""
    import proof_steps as steps
    if tiny:
        return steps.tiny_config("cogvlm")
    config = steps.full_config("cogvlm")
    return dict(config, num_layers=LAYERS, eva_args=dict(config["eva_args"], num_layers=LAYERS))


def spread(model) -> None:
    """At tiny size: norms' weights in [0.5, 1.5] (not all 1), so that they show in the logits (as in the export's
    parity tests); matrices stay std 0.02 (wider ones push a 2-layer model's 4-bit logits below the cosine bar)."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)


def make_exports(work: str, tiny: bool, hf_code: str, dev) -> dict:
    """The kit-made model, its SAT checkpoints, ``export hf`` of the base and ``export peft`` of the LoRA;
    SAT's logits (base, and with LoRA) on one input, and that input."""
    import torch
    import proof_steps as steps
    from sat_patches.cogvlm.saving import save_pretrained_dir
    from sat_patches.export.hf import export_hf
    from sat_patches.export.peft import export_peft
    from sat_patches.planning.shapes import default_seq_len, plan_config
    config = model_config(tiny)
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(0)
    model, args = steps.build_model(config, dev)
    if tiny:
        model = model.float()
        spread(model)
    model.eval()
    inputs = steps.batch_inputs(config, default_seq_len(plan_config(config)), 1, dev)
    inputs["vision_image"] = inputs["vision_image"].to(dtype)
    torch.manual_seed(1)
    inputs["input_ids"] = torch.randint(3, config["vocab_size"], inputs["input_ids"].shape, device=dev)
    with torch.no_grad():
        base_logits = model(**inputs)[0].float().cpu()
    paths = {k: os.path.join(work, k) for k in ("sat-base", "sat-lora", "hf", "peft")}
    save_pretrained_dir(model, args, paths["sat-base"])
    steps.add_lora(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "matrix_B" in name:
                p.normal_(0.0, 0.04)
    model.eval()
    with torch.no_grad():
        lora_logits = model(**inputs)[0].float().cpu()
    save_pretrained_dir(model, args, paths["sat-lora"])
    del model
    steps.free()
    hf = export_hf(paths["sat-base"], paths["hf"], hf_code=hf_code)
    peft = export_peft(paths["sat-lora"], paths["peft"], base_model=paths["hf"])
    return {"paths": paths, "inputs": inputs, "base": base_logits, "lora": lora_logits, "dtype": dtype,
            "config": config, "summary": f"export hf: {hf['tensors']} tensors; export peft: {peft['layers']} layers"}


def hf_call(inputs: dict, dtype, dev) -> dict:
    """The HF model's call for the kit's SAT input (``proof_peer.hf_inputs``), pixels in ``dtype`` on ``dev``."""
    from proof_peer import hf_inputs
    call = hf_inputs(inputs)
    call["images"] = [[image.to(dev, dtype) for image in sample] for sample in call["images"]]
    return call


def logits_of(model, call: dict):
    import torch
    with torch.no_grad():
        return model(**call).logits.float().cpu()


def equal(got, want, dtype) -> str:
    """``max |got - want|`` as a row's figure; raises when over the tolerance of ``dtype``."""
    import torch
    diff = float((got - want).abs().max())
    bound = EQUAL_FP32 if dtype == torch.float32 else EQUAL_BF16 * float(want.abs().max())
    assert float(want.abs().max()) > 100 * EQUAL_FP32, "SAT's logits are near zero: nothing to compare"
    assert diff <= bound, f"max |HF - SAT| {diff:.3g} > {bound:.3g}"
    return f"max |HF - SAT| {diff:.2g} (<= {bound:.2g}), largest logit {float(want.abs().max()):.3g}"


def run(rec: Recorder, tiny: bool, hf_code) -> None:
    """Part h: one row for the export, one per recipe."""
    why = why_skipped(hf_code)
    if why:
        for recipe in RECIPES:
            with rec.check(f"README recipe: {recipe}"):
                raise Skip(why)
        return
    from proof_steps import free
    dev = device()
    work = tempfile.mkdtemp(prefix="sat-patches-recipes-")
    try:
        _recipes(rec, tiny, os.path.abspath(hf_code), dev, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        free()


def _recipes(rec: Recorder, tiny: bool, hf_code: str, dev, work: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    held = {}
    with rec.check("kit-made CogVLM with LoRA: SAT checkpoints, export hf --hf-code, export peft") as row:
        held.update(make_exports(work, tiny, hf_code, dev))
        row.measured = held["summary"]
        row.detail = f"transformers {transformers.__version__}; code from {hf_code}"
    if not held:
        for recipe in RECIPES:
            with rec.check(f"README recipe: {recipe}"):
                raise Skip("the export failed (row above)")
        return
    paths, dtype = held["paths"], held["dtype"]
    name = "fp32 (tiny, CPU)" if dtype == torch.float32 else "bf16"
    with rec.check(f"README recipe: {RECIPES[0]} [{name}]") as row:
        model = AutoModelForCausalLM.from_pretrained(paths["hf"], trust_remote_code=True, torch_dtype=dtype).to(dev)
        model.eval()
        call = hf_call(held["inputs"], dtype, dev)
        held["plain"] = logits_of(model, call)
        row.measured = equal(held["plain"], held["base"], dtype)
        prompt = dict(call, use_cache=False)
        ids = prompt.pop("input_ids")
        with torch.no_grad():
            out = model.generate(ids, **prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        want = int(held["base"][0, -1].argmax())
        assert len(new) == NEW_TOKENS and new[0] == want, f"generated {new}; SAT's greedy next token {want}"
        row.detail = f"generate: {new} (the first is SAT's greedy next token)"
        del model
    with rec.check(f"README recipe: {RECIPES[1]}", expected=f"cosine >= {COSINE_4BIT}") as row:
        if "plain" not in held:
            raise Skip("needs the bf16 load's logits (row above)")
        from transformers import BitsAndBytesConfig
        try:
            model4 = AutoModelForCausalLM.from_pretrained(
                paths["hf"], trust_remote_code=True, quantization_config=BitsAndBytesConfig(load_in_4bit=True),
                torch_dtype=dtype)
        except Exception as exc:  # noqa: BLE001  (on the CPU: whatever refuses 4-bit there, said as it is)
            if cuda():
                raise
            raise Skip(f"4-bit load on CPU refused: {type(exc).__name__}: {exc}"[:300]) from exc
        four = sum(type(m).__name__ == "Linear4bit" for m in model4.modules())
        here = next(model4.parameters()).device
        logits = logits_of(model4, hf_call(held["inputs"], dtype, here))
        cosine = float(torch.nn.functional.cosine_similarity(logits.flatten(), held["plain"].flatten(), dim=0))
        row.measured = f"cosine {cosine:.4f} beside the {name} load"
        row.detail = f"{four} Linear4bit modules on {here}"
        assert four > 0, "no linear became Linear4bit"
        assert cosine >= COSINE_4BIT, f"cosine {cosine:.4f} < {COSINE_4BIT}"
        del model4
    with rec.check(f"README recipe: {RECIPES[2]} [{name}]") as row:
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained(paths["hf"], trust_remote_code=True, torch_dtype=dtype).to(dev)
        tuned = PeftModel.from_pretrained(base, paths["peft"]).eval()
        logits = logits_of(tuned, hf_call(held["inputs"], dtype, dev))
        row.measured = equal(logits, held["lora"], dtype)
        moved = float((held["lora"] - held["base"]).abs().max())
        adapted = sum(1 for n, _ in tuned.named_modules() if n.endswith(".lora_A"))
        row.detail = f"{adapted} adapted modules; the LoRA moves SAT's logits by up to {moved:.3g}"
        assert moved > 10 * (EQUAL_FP32 if dtype == torch.float32 else 0), "the adapter changes nothing"

"""Part h of the GPU proof: the README's Hugging Face recipes on an export, one row per recipe.

The recipes (README, "Use your fine-tuned model elsewhere"), each on the ``sat-patches export hf`` folder of a
kit-made model, with the version set of ``sat_patches.hf_recipes`` (transformers 4.41.2, accelerate 0.30.1,
peft 0.11.1, bitsandbytes 0.50.2; prepare.sh's peer wheels carry transformers and peft):

* bf16 load (``AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, torch_dtype="auto")``) and
  a few generated tokens; its logits beside SAT's, which they must equal;
* 4-bit load (``quantization_config=BitsAndBytesConfig(load_in_4bit=True)``) and a forward; logits beside the
  bf16 load's (quantised: close, not equal); CUDA only;
* the PEFT adapter (``sat-patches export peft``) on the exported base; logits beside SAT's with its LoRA.

Every recipe runs the released model's own remote code, which is not ours to ship: the part needs it as
``--hf-code DIR`` (as part p). Without it, or without transformers and peft, each recipe's row is
``skipped: <what is needed>``. The recipes' runs themselves are not in the kit yet: with everything present a
row says so (skipped), never ``ok``.
"""
from __future__ import annotations

from proof_record import Recorder, Skip

RECIPES = ("bf16 load + a few generated tokens, logits beside SAT's",
           "4-bit load + a forward, logits beside the bf16 load's",
           "the PEFT adapter on the exported base, logits beside SAT's with LoRA")
NOT_BUILT = "the recipe's run is not in the kit yet (its needs are met)"


def why_skipped(hf_code) -> str:
    """Why the recipes cannot run here: what part p's peer needs (the remote code, transformers and peft), or,
    when that is present, that the runs are not built."""
    from proof_peer import missing
    return missing(hf_code) or NOT_BUILT


def run(rec: Recorder, tiny: bool, hf_code) -> None:
    """Part h: one row per recipe (``tiny`` is the kit's CPU check; nothing here depends on the size yet)."""
    why = why_skipped(hf_code)
    for recipe in RECIPES:
        with rec.check(f"README recipe: {recipe}"):
            raise Skip(why)

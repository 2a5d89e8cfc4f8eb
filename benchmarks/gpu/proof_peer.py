"""Part p of the GPU proof: the peer beside us. The same CogVLM training step in one process on two stacks:

* HF + PEFT: the released model's own Hugging Face code (cogvlm-chat-hf's ``modeling_cogvlm.py``,
  ``visual.py``, ``configuration_cogvlm.py``, read from ``--hf-code DIR``: that code is not ours to ship, so
  the kit takes a local copy) with PEFT's LoRA;
* SAT + sat_patches: the step of part a (``proof_steps``: the same build, LoRA, inputs and step code).

Same shapes (the HF config is written from our config, ``sat_patches.export.names.hf_config``), random bf16
weights (one rule for both), the same micro-batch and tokens, the same step (forward, loss over shifted
tokens, backward, AdamW). LoRA r=10 on the layers SAT's ``LoraMixin`` adapts in part a: every language
layer's attention qkv and dense (HF ``language_expert_query_key_value`` / ``language_expert_dense``) and every
EVA layer's (``attention.query_key_value`` / ``attention.dense``). Activation checkpointing where the setting
asks for it: SAT's own switches; on the HF side ``torch.utils.checkpoint`` around each language and EVA layer
(the remote code refuses ``gradient_checkpointing_enable`` and never reads the flag). The trainable counts differ
by design: SAT's LoRA keeps three rank-r pairs on a fused qkv, PEFT one (both counts are in the rows). A step's
time is the median of the steps after the first (three at full size, two at tiny).

Settings: micro-batch 8 with every layer checkpointed, and micro-batch 1 without (2 and 1 with ``--tiny``).
Rows: the code loaded, PEFT's adapted modules, the device's matrix-product FLOP/s, one row per stack and
setting, the ratio per setting; the table (``peer_figures.table``) is printed and kept in the part's JSON
under ``peer_table``. Without ``--hf-code`` (or without transformers and peft) the part is one row
``skipped: <what is needed>``.

The GPU machine's image has transformers 5.x, which the remote code predates: prepare.sh carries
transformers 4.41.2, peft 0.11.1 and huggingface-hub 0.23.5, installed apart (``--peer-site DIR``) and put
first on ``sys.path`` by :func:`prepare_imports` before anything imports transformers, with a stand-in for
transformers' import-time dependency check (the image's tokenizers is newer than 4.41.2 accepts; the step
uses no tokenizer).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import statistics
import sys
import types

from proof_record import Recorder, Skip, device, gb

HF_CODE_FILES = ("modeling_cogvlm.py", "visual.py", "configuration_cogvlm.py")
HF_PACKAGE = "sat_patches_proof_cogvlm_hf"      # the name the remote code's folder is imported under
NEEDED = ("needs --hf-code DIR, a local copy of cogvlm-chat-hf's remote code (" + ", ".join(HF_CODE_FILES) + ")")
# HF names of the layers SAT's LoraMixin adapts (language model and EVA), as a PEFT target regex
LORA_TARGETS = (r".*(\.self_attn\.language_expert_(query_key_value|dense)"
                r"|\.vision\.transformer\.layers\.\d+\.attention\.(query_key_value|dense))")
SETTINGS = {False: ((8, True), (1, False)), True: ((2, True), (1, False))}   # tiny?: (micro-batch, checkpointed)


def prepare_imports(peer_site) -> None:
    """Before anything imports transformers: ``peer_site`` (the carried transformers and peft) first on
    ``sys.path``, and transformers' import-time version check stood in by a module that checks nothing."""
    if not peer_site:
        return
    sys.path.insert(0, os.path.abspath(peer_site))
    name = "transformers.dependency_versions_check"
    stub = types.ModuleType(name, "sat_patches GPU proof: the version check is skipped (no tokenizer is used)")
    stub.dep_version_check = lambda *args, **kwargs: None
    sys.modules.setdefault(name, stub)


def missing(hf_code) -> str:
    """Why the part cannot run (empty when it can)."""
    if not hf_code:
        return NEEDED
    if not os.path.isdir(hf_code):
        return f"{NEEDED}: {hf_code} is not a folder"
    absent = [f for f in HF_CODE_FILES if not os.path.isfile(os.path.join(hf_code, f))]
    if absent:
        return f"{NEEDED}: {hf_code} lacks {', '.join(absent)}"
    for module in ("transformers", "peft"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            return (f"needs transformers and peft (4.41.2 and 0.11.1: prepare.sh's peer wheels, --peer-site); "
                    f"{module}: {type(exc).__name__}: {exc}"[:300])
    return ""


def load_remote_code(folder: str):
    """``modeling_cogvlm`` and ``configuration_cogvlm`` of ``folder``, imported as one package (their relative
    imports, ``from .visual import ...``, resolve inside it), as transformers' dynamic modules would."""
    package = types.ModuleType(HF_PACKAGE)
    package.__path__ = [os.path.abspath(folder)]
    sys.modules[HF_PACKAGE] = package
    return (importlib.import_module(f"{HF_PACKAGE}.modeling_cogvlm"),
            importlib.import_module(f"{HF_PACKAGE}.configuration_cogvlm"))


def hf_model(folder: str, config: dict, dev):
    """The HF ``CogVLMForCausalLM`` of SAT config ``config``, built on ``dev`` in bf16, weights random as
    ``proof_steps.randomise`` makes them, with PEFT's LoRA; ``(peft model, adapted module names)``."""
    import peft
    import torch
    from proof_steps import LORA_RANK, randomise
    from sat_patches.export.names import hf_config
    modeling, configuration = load_remote_code(folder)
    hf = configuration.CogVLMConfig(**hf_config(config, "bfloat16"))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = modeling.CogVLMForCausalLM(hf)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():       # parameters only: buffers (rotary inv_freq) stay as the code made them
        for p in model.parameters():
            p.data = p.data.to(dev, torch.bfloat16)
    randomise(model)
    lora = peft.LoraConfig(r=LORA_RANK, lora_alpha=1, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = peft.get_peft_model(model, lora)
    adapted = sorted({name.rsplit(".lora_A", 1)[0] for name, _ in model.named_modules() if name.endswith(".lora_A")})
    return model, adapted


@contextlib.contextmanager
def checkpoint_each_layer(model, on: bool = True):
    """``torch.utils.checkpoint`` (non-reentrant) around every layer of every ``*.layers`` list of ``model``
    (the language model's and EVA's) while the block runs; ``on=False`` leaves them as they are."""
    import torch
    from torch.utils.checkpoint import checkpoint
    layers = [layer for name, stack in model.named_modules() if name.endswith("layers")
              and isinstance(stack, torch.nn.ModuleList) for layer in stack] if on else []
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward          # the class's forward again


def hf_inputs(inputs: dict) -> dict:
    """The HF model's call for the micro-batch ``proof_steps.batch_inputs`` made: the same token ids, image
    tokens marked in ``token_type_ids`` (boi, patches, eoi: SAT's ``image_embed_mask``), the same pixels."""
    return {"input_ids": inputs["input_ids"], "token_type_ids": inputs["image_embed_mask"],
            "images": [[image] for image in inputs["vision_image"]], "use_cache": False}


def matmul_flops_per_s(dev, tiny: bool) -> float:
    """FLOP/s of a large bf16 matrix product on ``dev`` (the best of ten): what utilisation is measured against."""
    import time

    import torch
    n = 256 if tiny else 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    best = float("inf")
    for _ in range(11):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def _stack_rows(rec: Recorder, stack: str, build, step, settings, figures_of) -> list:
    """Build one stack (``build()``: the model and what to say of it), run ``step(model, micro_batch,
    checkpointed)`` (``train_steps``' result) at every setting, free the model; its
    :class:`peer_figures.StepFigures` (``figures_of(stack, setting, micro_batch, result)``) as far as they came."""
    import peer_figures as figures
    from proof_steps import free
    out, holder = [], {}
    with rec.check(f"{stack}: build, random bf16 weights, LoRA r=10") as row:
        holder["model"], row.measured = build()
    model = holder.pop("model", None)
    for micro_batch, checkpointed in settings if model is not None else ():
        setting = figures.setting_name(micro_batch, checkpointed)
        with rec.check(f"{stack}: {setting}") as row:
            result = step(model, micro_batch, checkpointed)
            measured = figures_of(stack, setting, micro_batch, result)
            out.append(measured)
            row.measured = (f"step {measured.seconds:.3f} s, {measured.tokens_per_s:,.0f} tokens/s, "
                            f"{measured.utilisation:.0%} useful-FLOP utilisation"
                            + ("" if measured.peak is None else f", peak {gb(measured.peak)}"))
            row.detail = (f"{result['trainable']:,} trainable; step seconds "
                          f"{', '.join(f'{s:.3f}' for s in result['seconds'])}; losses "
                          + ", ".join(f"{x:.3f}" for x in result["losses"]))
    del model
    free()
    return out


def run(rec: Recorder, tiny: bool, hf_code) -> None:
    """Part p."""
    import peer_figures as figures
    import proof_steps as steps
    from sat_patches.planning.shapes import default_seq_len, plan_config
    with rec.check("peer: the released model's HF code + PEFT beside SAT + sat_patches") as row:
        why = missing(hf_code)
        if why:
            raise Skip(why)
        import peft
        import transformers
        row.measured = f"transformers {transformers.__version__}, peft {peft.__version__}, code from {hf_code}"
    if row.status != "ok":
        return
    dev = device()
    config = steps.tiny_config("cogvlm") if tiny else steps.full_config("cogvlm")
    tokens = default_seq_len(plan_config(config))
    useful = figures.useful_flops(config, tokens)
    with rec.check("bf16 matrix product on the device (what utilisation is measured against)") as row:
        peak_flops = matmul_flops_per_s(dev, tiny)
        row.measured = f"{peak_flops / 1e12:.3g} TFLOP/s"
        row.detail = f"useful work {useful:.3g} FLOP per {tokens}-token sample (forward + input-gradient backward)"
    count_steps = 2 if tiny else 3
    adapted = {}

    def figures_of(stack, setting, micro_batch, result):
        timed = result["seconds"][1:] or result["seconds"]   # the first step warms up
        return figures.StepFigures(stack, setting, micro_batch, tokens, statistics.median(timed), result["peak"],
                                   useful, peak_flops, adapted.get(stack, 0), result["trainable"])

    def batch(micro_batch):
        return steps.batch_inputs(config, tokens, micro_batch, dev)

    def hf_build():
        model, names = hf_model(hf_code, config, dev)
        adapted[figures.PEER] = len(names)
        expected = 2 * (config["num_layers"] + config["eva_args"]["num_layers"])
        assert len(names) == expected, f"PEFT adapted {len(names)} modules, not {expected}: {names[:4]}"
        return model, f"PEFT adapted {len(names)} modules ({names[0]}, ...)"

    def hf_step(model, micro_batch, checkpointed):
        with checkpoint_each_layer(model, checkpointed):
            return steps.train_steps(model, hf_inputs(batch(micro_batch)), config["vocab_size"], count_steps)

    def sat_build():
        model, _ = steps.build_model(config, dev)
        steps.add_lora(model)
        adapted[figures.OURS] = len({n.split(".matrix_A")[0] for n, _ in model.named_parameters() if ".matrix_A" in n})
        return model, f"LoraMixin on {config['num_layers']} language and {config['eva_args']['num_layers']} EVA layers"

    def sat_step(model, micro_batch, checkpointed):
        steps.checkpointing(model, checkpointed)
        return steps.train_steps(model, batch(micro_batch), config["vocab_size"], count_steps)

    settings = SETTINGS[tiny]
    rows = _stack_rows(rec, figures.PEER, hf_build, hf_step, settings, figures_of)
    rows += _stack_rows(rec, figures.OURS, sat_build, sat_step, settings, figures_of)
    for setting, ratio in figures.ratios(rows).items():
        with rec.check(f"sat_patches / HF tokens/s, {setting}") as row:
            row.measured = f"{ratio:.2f}x"
    rec.extra["peer_table"] = figures.as_dicts(rows)
    rec.save()
    print("\n" + figures.table(rows) + "\n", flush=True)

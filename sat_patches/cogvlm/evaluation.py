"""Evaluation by generation (``sat-patches evaluate``): a saved model answers every sample of a data set by
greedy decoding, each data-parallel group its share; rank 0 writes ``predictions.jsonl`` and ``summary.json``
and prints exact match and a per-character score (:mod:`.scores`).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Dict, List

import torch
import torch.distributed as dist
from sat import mpu

from ..checkpoints import adapter
from ..checkpoints.files import CheckpointError, find_checkpoint
from ..checkpoints.model_config import read_model_config
from ..checkpoints.loading import load_checkpoint
from ..checkpoints.merge import model_class
from ..checkpoints.writer import write_text_atomic
from ..data.jsonl import DataError, check_data_path, write_jsonl
from ..lora.layer import has_lora
from . import create_dataset_function, data_collator, llama2_tokenizer, model_class_for
from .scores import summarise, summary_line
from .trainer import add_lora, model_inputs, processors


def greedy_answer(model, batch, tokenizer, steps: int = 8) -> str:
    """Greedy decoding after the batch's prompt (its first ``context_length`` tokens), without a cache."""
    with torch.no_grad(), towers_run_once(model):
        tokens = _decode(model, batch, model_inputs(batch), tokenizer.eos_token_id, steps)
    # SAT pads the vocabulary (to a multiple of 128): an id past the tokenizer's is a padding slot, no text
    # (transformers before 4.42 raises for it: "piece id is out of range")
    return tokenizer.decode([t for t in tokens if t < len(tokenizer)])


# the image towers, by upstream's parameter names (a checkout's classes have them too): EVA2-CLIP of CogVLM and
# CogAgent, and CogAgent's high-resolution cross encoder
IMAGE_TOWERS = ("mixins.eva.vit_model", "mixins.encoder.vit")


@contextlib.contextmanager
def towers_run_once(model):
    """Each image tower of ``model`` (in eval mode) runs once per image object while decoding without a cache
    re-runs the whole sequence per token; the ranks of a model-parallel group skip the same steps."""
    modules = dict(model.named_modules())
    towers = [modules[name] for name in IMAGE_TOWERS if name in modules]
    for tower in towers:
        tower.forward = _once(tower.forward)
    try:
        yield
    finally:
        for tower in towers:
            del tower.forward  # the class's own again


def _once(forward):
    seen = {}

    def reused(*args, **kwargs):
        key = tuple(map(id, args)) + tuple((k, id(v)) for k, v in sorted(kwargs.items()))
        if key not in seen:  # the arguments are kept with the output: their ids stay theirs
            seen[key] = (args, kwargs, forward(*args, **kwargs))
        return seen[key][2]
    return reused


def _decode(model, batch, inputs, eos: int, steps: int) -> List[int]:
    context = int(batch["context_length"][0])
    ids = batch["input_ids"][:, :context].clone()
    out = []
    for _ in range(steps):
        n = ids.shape[1]
        step_inputs = {k: (v[:, :n] if k in ("vision_expert_mask", "image_embed_mask", "image_rope_mask",
                                              "position_ids") else v) for k, v in inputs.items()}
        step_inputs["attention_mask"] = inputs["attention_mask"][..., :n, :n]
        step_inputs["input_ids"] = ids
        token = int(model(**step_inputs)[0][0, -1].argmax())
        if token == eos:
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
        last = inputs["position_ids"][:, n - 1:n] + 1
        inputs["position_ids"] = torch.cat([inputs["position_ids"][:, :n], last], dim=1)
        for key in ("vision_expert_mask", "image_embed_mask", "image_rope_mask"):
            inputs[key] = torch.cat([inputs[key][:, :n], torch.zeros_like(inputs[key][:, :1])], dim=1)
        inputs["attention_mask"] = torch.ones(1, 1, n + 1, n + 1, device=ids.device).tril()
    return out


def check_inputs(ckpt: str, data: str, mp: int, world: int) -> List[str]:
    """What stops the evaluation before anything is loaded."""
    problems = []
    try:
        find_checkpoint(ckpt)
    except CheckpointError as exc:
        problems.append(str(exc))
    problems += check_data_path(data)
    if mp < 1 or world % mp:
        problems.append(f"--mp {mp} does not divide the {world} rank(s): run on a multiple of {mp} ranks "
                        f"(torchrun --nproc-per-node) or choose --mp from {[d for d in range(1, world + 1) if world % d == 0]}")
    return problems


def load_for_generation(ckpt: str, kind: str, mp: int, imports=()):
    """The checkpoint's model at MP=``mp``, in eval mode. A LoRA run's checkpoint (``use_lora``/``use_qlora``
    in its config) gets the LoRA layers its training added before its weights are loaded, unless its model
    class adds them itself; an adapter-only save is loaded onto its base (named in its ``adapter.json``).
    With ``imports`` (modules that register it) the class is the checkpoint's own ``model_class``."""
    run = find_checkpoint(ckpt)
    manifest = adapter.read_manifest(os.path.dirname(run.files[0]))
    cls = model_class(read_model_config(ckpt)["model_class"], imports) if imports else model_class_for(kind)
    size = {"model_parallel_size": mp}
    if manifest is None:
        model, args = cls.from_pretrained(ckpt, None, build_only=True, overwrite_args=size)
    else:
        base = adapter.base_checkpoint(manifest, ckpt)
        model, args = cls.from_pretrained(base.path, None, overwrite_args=size,
                                          specific_iteration=None if base.release else base.iteration)
        config = read_model_config(ckpt)
        for key in ("use_lora", "use_qlora", "lora_rank", "layer_range"):
            setattr(args, key, config.get(key, getattr(args, key, None)))
    if (getattr(args, "use_lora", False) or getattr(args, "use_qlora", False)) and not has_lora(model):
        add_lora(model, args)
    args.mode = "inference"
    load_checkpoint(model, args, load_path=ckpt)
    model.eval()
    return model, args


def evaluate(ckpt: str, data: str, tokenizer_dir: str, mp: int = 1, out: str = "evaluation", version: str = "base",
             max_length: int = 2048, max_new_tokens: int = 16, imports=()) -> Dict:
    """(every rank) Load ``ckpt`` at MP=``mp`` and answer every sample of ``data``; rank 0 writes and returns
    the summary."""
    problems = check_inputs(ckpt, data, mp, int(os.environ.get("WORLD_SIZE", "1")))
    if problems:
        raise DataError("\n".join(problems))
    config = read_model_config(ckpt, need_class=True)
    model, args = load_for_generation(ckpt, "cogagent" if "Agent" in config["model_class"] else "cogvlm", mp,
                                      imports)
    args.max_length = max_length
    summary = answer_every_sample(model, args, data, tokenizer_dir, out, version, max_new_tokens)
    if summary:
        summary["checkpoint"] = os.path.abspath(ckpt)
    return summary


def answer_every_sample(model, args, data: str, tokenizer_dir: str, out: str, version: str = "base",
                        max_new_tokens: int = 16, label: str = "evaluation") -> Dict:
    """(every rank) ``model`` (built and loaded at the job's model-parallel size) answers every sample of
    ``data``, each data-parallel group its share; rank 0 writes ``predictions.jsonl`` and ``summary.json``
    into ``out``, prints the summary line (starting with ``label``) and returns the summary (the other
    ranks: ``{}``)."""
    module = getattr(model, "module", model)
    was_training = module.training
    module.eval()
    tokenizer = llama2_tokenizer(tokenizer_dir, signal_type=version)
    image, text, cross = processors(args, tokenizer)
    dataset = create_dataset_function(image, text, cross, data, args)
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    device = next(module.parameters()).device
    mine = []
    for index in range(dp_rank, len(dataset), dp_size):
        item = dataset[index]
        row = {"index": index, "id": item.get("question_id", str(index)), "answer": dataset.answer_of(index),
               "prompt": dataset.prompt_text(index), "image": dataset.image_of(index), "prediction": None}
        if item:
            batch = data_collator([item], cross_image_processor=cross)
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            row["prediction"] = greedy_answer(module, batch, tokenizer, max_new_tokens).strip()
        mine.append(row)
    module.train(was_training)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return {}
    rows = sorted({r["index"]: r for part in everyone for r in part}.values(), key=lambda r: r["index"])
    for row in rows:
        row["prediction"] = row["prediction"] or ""
        row["exact"] = row["prediction"] == row["answer"].strip()
    summary = {**summarise(rows), "data": os.path.abspath(data), "mp": mpu.get_model_parallel_world_size(),
               "data_parallel": dp_size}
    os.makedirs(out, exist_ok=True)
    write_jsonl(os.path.join(out, "predictions.jsonl"), [{k: r[k] for k in ("id", "image", "prompt", "answer",
                                                                            "prediction", "exact")} for r in rows])
    write_text_atomic(os.path.join(out, "summary.json"), json.dumps(summary, indent=2))
    print(summary_line(summary, data, label) + f" (predictions: {os.path.join(out, 'predictions.jsonl')})", flush=True)
    return summary

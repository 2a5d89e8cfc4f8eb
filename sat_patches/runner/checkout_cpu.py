"""The CPU smoke run of a CogVLM checkout: what it needs, made locally, and a check of what it made.

    python -m sat_patches.runner.checkout_cpu prepare --checkout ROOT --kind cogvlm --workdir WORK
    python -m sat_patches.runner.checkout_cpu verify  --checkout ROOT --kind cogvlm --workdir WORK --mp 2

``prepare`` writes under WORK a tiny checkpoint built with the checkout's own ``utils.models`` classes
(``model/``), a small LLaMA tokenizer (``tokenizer/``) and CAPTCHA images (``data/train``, ``data/valid``).
``verify`` checks the training checkpoint and the demo's merged one (a shard per model-parallel rank), joins
the merged shards into ``merged_mp1/``, loads that strictly into the checkout's class and runs one image.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import importlib
import json
import math
import os
import shutil
import sys
from typing import Dict

import torch
from sat.arguments import _simple_init

import sat_patches

from sat_patches.cogvlm import check_vocab, data_collator, llama2_tokenizer, make_captcha_dataset, train_tiny_tokenizer
from sat_patches.cogvlm.config import CONFIG_FIELDS, tiny_config
from sat_patches.core import kinds
from sat_patches.core.ports import free_port
from sat_patches.cogvlm.trainer import lm_loss, model_inputs
from sat_patches.checkpoints.merge import merge
from sat_patches.runner.steps import latest_run

FORK_PATCHES = ("fork_expert_routing_mlp", "fork_expert_routing_attention")  # sat_patches.patches.fork_models

# parameters upstream creates with skip_init=True (no initialisation): the vision-expert mixins
UNINITIALISED_PREFIXES = ("mixins.mlp.", "mixins.rotary.")


@contextlib.contextmanager
def checkout_on_path(checkout: str):
    """The checkout root first on ``sys.path`` (its ``utils`` package), as its demos arrange it."""
    root = os.path.abspath(checkout)
    if not os.path.isfile(os.path.join(root, "utils", "models", "__init__.py")):
        raise SystemExit(f"error: {root} has no utils/models/__init__.py: --checkout must be the root of a "
                         f"CogVLM checkout (the directory that holds finetune_demo/ and utils/)")
    sys.path.insert(0, root)
    try:
        yield root
    finally:
        sys.path.remove(root)


def checkout_class(checkout: str, name: str):
    """``utils.models.<name>`` of the checkout."""
    with checkout_on_path(checkout):
        models = importlib.import_module("utils.models")
    try:
        return getattr(models, name)
    except AttributeError:
        raise SystemExit(f"error: {checkout}/utils/models does not define {name}") from None


def _build_args(cls, config: dict, seed: int):
    args = cls.get_args()
    run = {"mode": "finetune", "fp16": False, "bf16": False, "device": "cpu", "seed": seed, "skip_init": False,
           "use_gpu_initialization": False, "deepspeed": False, "world_size": 1, "rank": 0, "local_rank": 0,
           "checkpoint_activations": False, "checkpoint_num_layers": 1, "hidden_dropout": 0.0,
           "attention_dropout": 0.0, "model_parallel_size": 1}
    for key, value in {**run, **copy.deepcopy(config)}.items():
        setattr(args, key, value)
    return args


def _single_process():
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
    _simple_init(model_parallel_size=1, seed=1)


def build_tiny_checkpoint(checkout: str, kind: str, out_dir: str, seed: int = 1234, config: dict = None,
                          dtype: torch.dtype = torch.float32) -> dict:
    """Build ``kind`` with the checkout's own class and save it under ``out_dir``, its tensors in ``dtype``.
    ``config``: the model's config in upstream's keys (default: the tiny one; the GPU proof passes full widths)."""
    config = config or tiny_config(kind, upstream_classes=True)
    cls = checkout_class(checkout, kinds.kind(kind).model_class)
    _single_process()
    torch.manual_seed(seed)
    model = cls(_build_args(cls, config, seed))
    with torch.no_grad():  # values for what upstream leaves uninitialised: weights N(0, 0.02), vectors zero
        for name, p in model.named_parameters():
            if name.startswith(UNINITIALISED_PREFIXES):
                (p.normal_(0.0, 0.02) if p.dim() >= 2 else p.zero_())
            elif not torch.isfinite(p).all():
                raise RuntimeError(f"parameter {name} holds non-finite values after building the model")
    os.makedirs(os.path.join(out_dir, "1"), exist_ok=True)
    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
             for k, v in model.state_dict().items()}
    del model
    torch.save({"module": state, "iteration": 1}, os.path.join(out_dir, "1", "mp_rank_00_model_states.pt"))
    with open(os.path.join(out_dir, "latest"), "w") as f:
        f.write("1")
    ordered = {k: config[k] for k in CONFIG_FIELDS if k in config}
    ordered.update({k: v for k, v in config.items() if k not in ordered})
    with open(os.path.join(out_dir, "model_config.json"), "w", encoding="utf-8") as f:
        json.dump(ordered, f, indent=4)
    return {"parameters": sum(v.numel() for v in state.values()), "class": f"{cls.__module__}.{cls.__name__}"}


def prepare(checkout: str, kind: str, workdir: str, n_train: int = 32, n_valid: int = 4, seed: int = 0,
            config: dict = None, dtype: torch.dtype = torch.float32) -> Dict[str, str]:
    """The model (``config``: the tiny one by default), tokenizer and CAPTCHA data of a run, under ``workdir``."""
    paths = {"model": os.path.join(workdir, "model"), "tokenizer": os.path.join(workdir, "tokenizer"),
             "train": os.path.join(workdir, "data", "train"), "valid": os.path.join(workdir, "data", "valid")}
    # an earlier run's merge (perhaps at another MP_SIZE) would be checked instead of this run's
    for old in [merged_dir(kind, workdir), os.path.join(workdir, "merged_mp1")]:
        if os.path.isdir(old):
            print(f"removing the previous run's {old}", flush=True)
            shutil.rmtree(old)
    train_tiny_tokenizer(paths["tokenizer"], seed=seed)
    train = make_captcha_dataset(paths["train"], n_train, seed=seed)
    labels = [os.path.splitext(os.path.basename(p))[0] for p in train]
    make_captcha_dataset(paths["valid"], n_valid, seed=seed + 1, exclude=labels)
    config = config or tiny_config(kind, upstream_classes=True)
    check_vocab(llama2_tokenizer(paths["tokenizer"]), config["vocab_size"], config["pad_token_id"])
    info = build_tiny_checkpoint(checkout, kind, paths["model"], config=config, dtype=dtype)
    print(f"prepared for the run of {kind}: {info['class']} ({info['parameters'] / 1e6:.1f}M parameters) "
          f"in {paths['model']}, tokenizer {paths['tokenizer']}, data {paths['train']} / {paths['valid']}", flush=True)
    return paths


# ----------------------------------------------------------------------------- verify
def merged_dir(kind: str, workdir: str) -> str:
    image_size = tiny_config(kind, upstream_classes=True)["eva_args"]["image_size"][0]
    return os.path.join(workdir, kinds.kind(kind).merged_dir.format(image_size=image_size))


def _expect_shards(what: str, directory: str, mp: int) -> None:
    if not os.path.isfile(os.path.join(directory, "latest")):
        raise SystemExit(f"error: {what} is missing: no {directory}/latest")
    want = [f"mp_rank_{r:02d}_model_states.pt" for r in range(mp)]
    with open(os.path.join(directory, "latest")) as f:
        tag = f.read().strip()
    got = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, tag, "mp_rank_*_model_states.pt")))
    if got != want:
        raise SystemExit(f"error: {what} {directory} holds {got}, expected one shard per model-parallel rank: {want}")


@torch.no_grad()
def verify(checkout: str, kind: str, workdir: str, mp: int, version: str = "base", max_length: int = 80) -> dict:
    trained = latest_run(os.path.join(workdir, "checkpoints"))
    _expect_shards("the training checkpoint", trained, mp)
    merged = merged_dir(kind, workdir)
    _expect_shards("the demo's merged checkpoint", merged, mp)
    with open(os.path.join(merged, "model_config.json")) as f:
        config = json.load(f)
    if config.get("use_lora"):
        raise SystemExit(f"error: {merged}/model_config.json says use_lora: the demo saved before merging the LoRA")
    single = os.path.join(workdir, "merged_mp1")
    cls = checkout_class(checkout, config["model_class"])  # registers the checkout's classes first
    with checkout_on_path(checkout):
        info = merge(merged, single, overwrite=True, imports=("utils.models",))
        if info["lora_layers"]:
            raise SystemExit(f"error: {merged} still holds LoRA matrices ({info['lora_layers']} layers)")
        _single_process()
        # the run settings upstream's own inference demo passes (its ImageMixin reads them)
        run = argparse.Namespace(deepspeed=None, local_rank=0, rank=0, world_size=1, model_parallel_size=1,
                                 mode="inference", skip_init=True, use_gpu_initialization=False, device="cpu",
                                 bf16=False, fp16=False)
        model, args = cls.from_pretrained(single, run)
        model.eval()
        reload = lambda: cls.from_pretrained(single, run)[0].eval()  # noqa: E731
        saved = torch.load(os.path.join(single, "1", "mp_rank_00_model_states.pt"), map_location="cpu",
                           mmap=True, weights_only=True)["module"]
        expected = set(model.state_dict())
        if set(saved) != expected:
            raise SystemExit(f"error: the merged checkpoint does not fit the checkout's {config['model_class']}: "
                             f"missing {sorted(expected - set(saved))[:5]}, unexpected {sorted(set(saved) - expected)[:5]}")
        utils = importlib.import_module("utils.utils")
        tokenizer = utils.llama2_tokenizer(os.path.join(workdir, "tokenizer"), signal_type=version)
        image = utils.get_image_processor(args.eva_args["image_size"][0])
        cross = utils.get_image_processor(args.cross_image_pix) if kind == "cogagent" else None
        text = utils.llama2_text_processor(tokenizer, max_length, args.image_length)
        dataset = utils.ItemDataset(image, text, args, os.path.join(workdir, "data", "valid"),
                                    cross_image_processor=cross)
    batch = data_collator([dataset[0]], cross_image_processor=cross)
    loss_of = lambda m: float(lm_loss(m, {**model_inputs(batch), "labels": batch["labels"]}))  # noqa: E731
    loss = loss_of(model)
    if not math.isfinite(loss):
        raise SystemExit(f"error: the merged model's loss on {dataset.data_dir} is {loss}")
    with checkout_on_path(checkout):
        routing = fork_routing_check(reload, loss_of, loss)
    print(f"training checkpoint: {trained} ({mp} shards)\n"
          f"demo's merged checkpoint: {merged} ({mp} shards, LoRA merged)\n"
          f"joined into {single}, loaded into the checkout's {config['model_class']}: loss {loss:.3f} on "
          f"CAPTCHA '{batch['question_id']}'\n{routing}", flush=True)
    return {"trained": trained, "merged": merged, "merged_mp1": single, "loss": loss}


def fork_routing_check(reload, loss_of, loss: float) -> str:
    """The checkout's vision-expert mixins under sat_patches: the fork patches' status and, where they are applied,
    the merged model's loss with the fork's own boolean-mask routing beside the patched routing (must be equal)."""
    rows = [r for r in sat_patches.status() if r["name"] in FORK_PATCHES]
    states = ", ".join(f"{r['name']} {r['status']}" + (f" ({r['reason']})" if r["reason"] else "") for r in rows)
    if any(r["status"] != "applied" for r in rows):
        return f"the checkout's vision-expert mixins: {states}"
    sat_patches.unpatch(*FORK_PATCHES)
    try:
        own = loss_of(reload())  # (SAT binds a mixin's hooks when the model is built)
    finally:
        sat_patches.apply()
    if not math.isclose(own, loss, rel_tol=1e-5, abs_tol=1e-6):
        raise SystemExit(f"error: the checkout's own routing gives loss {own!r}, the patched routing {loss!r}")
    return (f"the checkout's vision-expert mixins: {states}; loss with the checkout's own routing {own:.6f}, "
            f"patched {loss:.6f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sat_patches.runner.checkout_cpu", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("prepare", "verify"):
        s = sub.add_parser(name)
        s.add_argument("--checkout", required=True, help="root of the CogVLM checkout (holds finetune_demo/, utils/)")
        s.add_argument("--kind", choices=kinds.NAMES, default="cogvlm")
        s.add_argument("--workdir", required=True)
        if name == "verify":
            s.add_argument("--mp", type=int, required=True, help="model-parallel size of the run")
            s.add_argument("--version", default="base")
            s.add_argument("--max_length", type=int, default=80)
    a = p.parse_args(argv)
    workdir = os.path.abspath(a.workdir)
    if a.command == "prepare":
        prepare(a.checkout, a.kind, workdir)
    else:
        verify(a.checkout, a.kind, workdir, a.mp, a.version, a.max_length)
    return 0


if __name__ == "__main__":
    sys.exit(main())

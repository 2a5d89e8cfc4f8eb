"""Everything a tiny CogVLM/CogAgent fine-tuning run needs, made locally in one folder: ``prepare_tiny_run``
writes ``tokenizer/``, ``data/train``, ``data/valid`` and a random model in SAT's checkpoint layout (``model/``).
"""
from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch
from sat.model.base_model import get_model

from ..data.jsonl import write_jsonl
from .captcha_data import make_captcha_dataset
from .config import TINY_MAX_LENGTH, _run_defaults, tiny_config, write_model_config
from .models import model_class_for
from .saving import save_pretrained_dir
from .shapes_data import TOKENIZER_VOCAB, make_shapes_dataset, tokenizer_text
from .tokenizer import check_vocab, llama2_tokenizer, train_tiny_tokenizer


@dataclass
class TinyRun:
    kind: str
    model_dir: str
    tokenizer_dir: str
    train_dir: str
    valid_dir: str
    max_length: int = TINY_MAX_LENGTH

    @property
    def train_jsonl(self) -> str:
        return os.path.join(os.path.dirname(self.train_dir), "train.jsonl")

    @property
    def valid_jsonl(self) -> str:
        return os.path.join(os.path.dirname(self.valid_dir), "valid.jsonl")


def build_tiny_model(kind: str = "cogvlm", **overrides):
    """``(model, args)`` of the tiny FineTuneTrain model, built with SAT's ``get_model``."""
    args = tiny_args(kind, **overrides)
    return get_model(args, model_class_for(kind)), args


TASKS = ("captcha", "shapes")


HEAD_SCALE = 10.0


def prepare_tiny_run(workdir: str, kind: str = "cogvlm", n_train: int = 64, n_valid: int = 8,
                     seed: int = 0, task: str = "captcha") -> TinyRun:
    """Tokenizer, data and a random tiny model in ``workdir``. ``task``: ``captcha`` (``<label>.jpg``
    folders, as upstream's demo reads them, and the same images as conversations in JSON Lines) or
    ``shapes`` (coloured shapes in JSON Lines, :mod:`.shapes_data`: what the CPU demo learns in a minute)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, not {task!r}")
    run = TinyRun(kind, os.path.join(workdir, "model"), os.path.join(workdir, "tokenizer"),
                  os.path.join(workdir, "data", "train"), os.path.join(workdir, "data", "valid"))
    if task == "shapes":
        train_tiny_tokenizer(run.tokenizer_dir, extra_text=tokenizer_text(), vocab_size=TOKENIZER_VOCAB, seed=seed)
        make_shapes_dataset(run.train_jsonl, n_train, seed=seed)
        make_shapes_dataset(run.valid_jsonl, n_valid, seed=seed + 1)
    else:
        train_tiny_tokenizer(run.tokenizer_dir, seed=seed)
        train = make_captcha_dataset(run.train_dir, n_train, seed=seed)
        train_labels = [os.path.splitext(os.path.basename(p))[0] for p in train]
        make_captcha_dataset(run.valid_dir, n_valid, seed=seed + 1, exclude=train_labels)
        write_captcha_conversations(run.train_dir, run.train_jsonl)
        write_captcha_conversations(run.valid_dir, run.valid_jsonl, turns=False)
    model, args = build_tiny_model(kind, seed=1234 + seed)  # SAT needs a seed > 0
    if task == "shapes":  # at SAT's init no logit exceeds about 2.6: too flat for LoRA alone to make answers confident
        with torch.no_grad():
            model.get_mixin("lm").lm_head.weight.mul_(HEAD_SCALE)
    check_vocab(llama2_tokenizer(run.tokenizer_dir), args.vocab_size, args.pad_token_id)
    save_pretrained_dir(model, args, run.model_dir)
    return run


def write_captcha_conversations(images: str, path: str, turns: bool = True) -> int:
    """A JSONL file of the CAPTCHA images in ``images`` (``sat_patches.data.jsonl``'s format): the
    answer to ``CAPTCHA:`` is the label; with ``turns``, every third record is a two-turn conversation
    (the number of characters, then the label) and every third a grounding question (a box in CogVLM's
    ``[[x0,y0,x1,y1]]`` form). Returns the number of records."""
    records = []
    for i, image in enumerate(sorted(os.listdir(images))):
        label, rel = os.path.splitext(image)[0], os.path.relpath(os.path.join(images, image), os.path.dirname(path))
        if turns and i % 3 == 1:
            records.append({"image": rel, "conversations": [
                {"user": "How many characters?", "assistant": str(len(label))},
                {"user": "CAPTCHA:", "assistant": label}]})
        elif turns and i % 3 == 2:
            records.append({"image": rel, "prompt": "Where is the text?", "answer": "[[50,100,950,900]]"})
        else:
            records.append({"image": rel, "prompt": "CAPTCHA:", "answer": label})
    write_jsonl(path, records)
    return len(records)


def tiny_args(kind: str = "cogvlm", directory: Optional[str] = None, finetune: bool = True,
              **overrides) -> argparse.Namespace:
    """Arguments for ``sat.model.base_model.get_model(args, model_cls)`` building the tiny ``kind``
    ('cogvlm' or 'cogagent'): the model class's SAT defaults, the tiny config, single-process CPU
    run settings (no dropout), then ``overrides``. With ``directory``, also writes
    ``directory/model_config.json``. ``args.model_class`` names the matching FineTuneTrain class."""
    config = tiny_config(kind)
    cls = model_class_for(config["model_class"], finetune=finetune)
    args = cls.get_args()
    for key, value in {**_run_defaults(), **copy.deepcopy(config), **overrides}.items():
        setattr(args, key, value)
    args.model_class = cls.__name__
    if directory is not None:
        write_model_config(args, directory)
    return args

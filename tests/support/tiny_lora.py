"""A tiny LLaMA + LoRA model and SAT ``training_main`` script for CPU ranks.

Run on 2 ranks:  ``torchrun --nproc-per-node 2 -m tiny_lora --model-parallel-size 2``
(with ``import sat_patches`` first, e.g. through ``python -m sat_patches.launch``). Every rank
writes its per-iteration losses to ``--loss-log`` (a JSON file per rank) when given.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from sat import get_args, mpu
from sat.model.finetune.lora2 import LoraMixin
from sat.model.official.llama_model import LLaMAModel
from sat.training import deepspeed_training  # its functions looked up at call time: patched or replaced

from sat_patches.checkpoints.lora_names import is_adapter
from fake_backend import register_cuda_only_backend, simulate_cuda_barrier

VOCAB = 1024  # SAT's BaseTransformer makes a plain nn.Embedding below 1000 words, a model-parallel one from 1000
DEFAULT_ARGS = [
    "--mode", "finetune", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--vocab-size", str(VOCAB), "--max-sequence-length", "64", "--train-iters", "12",
    "--batch-size", "4", "--lr", "0.2", "--lr-decay-style", "constant",
    "--log-interval", "2", "--train-data", "synthetic", "--split", "1", "--seed", "1234",
    "--save-interval", "100000", "--eval-interval", "100000", "--num-workers", "0",
    "--experiment-name", "tiny-lora",
]
SEQ_LEN = 16


def model_class():

    class TinyLoraLLaMA(LLaMAModel):
        def __init__(self, args, transformer=None, **kwargs):
            super().__init__(args, transformer=transformer, **kwargs)
            self.add_mixin("lora", LoraMixin(args.num_layers, args.lora_rank, layer_range=None), reinit=True)

        def disable_untrainable_params(self):
            for name, p in self.named_parameters():
                p.requires_grad_(is_adapter(name))

        @classmethod
        def add_model_specific_args(cls, parser):
            super().add_model_specific_args(parser)
            parser.add_argument_group("TinyLora").add_argument("--lora-rank", type=int, default=4)
            return parser

    return TinyLoraLLaMA


class CountingDataset(torch.utils.data.Dataset):
    """Sequences that count upwards modulo a small alphabet: learnable in a few steps."""

    def __init__(self, n=512, alphabet=32, seq_len=SEQ_LEN, seed=0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, alphabet, (n,), generator=g)
        self.data = (starts[:, None] + torch.arange(seq_len)[None, :]) % alphabet + 10

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"tokens": self.data[i]}


def create_dataset(path, args):
    return CountingDataset()


def forward_step(data_iterator, model, args, timers):
    timers("batch generator").start()
    data = next(data_iterator) if data_iterator is not None else None
    tokens = mpu.broadcast_data(["tokens"], data, torch.int64)["tokens"]
    timers("batch generator").stop()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    position_ids = torch.arange(seq, device=inputs.device).unsqueeze(0).expand_as(inputs)
    mask = torch.ones(1, 1, seq, seq, device=inputs.device).tril()
    logits = model(input_ids=inputs, position_ids=position_ids, attention_mask=mask)[0]
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    _record(args, loss)
    return loss, {}


_LOSSES = []


def _record(args, loss):
    if getattr(args, "loss_log", None):
        _LOSSES.append(float(loss.detach()))
        with open(args.loss_log.format(rank=torch.distributed.get_rank()), "w") as f:
            json.dump(_LOSSES, f)


def main(argv=None):
    py_parser = argparse.ArgumentParser(add_help=False)
    py_parser.add_argument("--loss-log", default=None, help="JSON file per rank; '{rank}' is filled in")
    argv = sys.argv[1:] if argv is None else argv
    py_parser.add_argument("--cuda-only-backend", default=None,
                           help="register a CUDA-only backend of this name (fake_backend) and use it")
    known, rest = py_parser.parse_known_args(argv)
    if known.cuda_only_backend:
        rest += ["--distributed-backend", register_cuda_only_backend(known.cuda_only_backend)]
        simulate_cuda_barrier()
    cls = model_class()
    parser = cls.add_model_specific_args(argparse.ArgumentParser(description="tiny lora"))
    args = get_args(DEFAULT_ARGS + rest, parser)
    args.loss_log = known.loss_log
    deepspeed_training.training_main(args, model_cls=cls, forward_step_function=forward_step, create_dataset_function=create_dataset)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    main()

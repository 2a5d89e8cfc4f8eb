"""Fine-tune scripts of other SAT models, written the way their users write them (our own stand-ins).

* :class:`FineTuneChatGLM2`: SAT's ChatGLM2 LoRA fine-tune pattern: a ``ChatGLM2Model`` subclass that adds
  ``LoraMixin`` in its constructor (``LoraMixin(qlora=True)`` with ``--use_qlora``, as VisualGLM-6B's script
  does), loaded with ``from_pretrained(path, args)`` and no ``overwrite_args``, trained by ``training_main``.
* :class:`LoraCogVLM`: a CogVLM fine-tune class that adds LoRA in its constructor.
* :func:`write_base`: a released-style base checkpoint (plain ``ChatGLM2Model``, saved at model-parallel size 1).

Run on ranks with :func:`main` (``run_ranks(other_sat_scripts.main, n, args=(argv,))``); every rank returns what
it saw at its first training step: the loss, the model-parallel size and the rows of the word embedding it holds.
"""
from __future__ import annotations

import argparse

import torch

import sat_patches  # noqa: F401  (before SAT, as sat_patches.launch does)
from sat.model.finetune.lora2 import LoraMixin
from sat.model.official.chatglm2_model import ChatGLM2Model
from sat_patches.cogvlm.models import FineTuneTrainCogVLMModel

# ChatGLM2-6B's shape at tiny size: multi-query attention with 2 key/value groups, SwiGLU, RMSNorm
CONFIG = dict(model_class="ChatGLM2Model", num_layers=2, hidden_size=64, num_attention_heads=4,
              num_multi_query_heads=2, vocab_size=1024, inner_hidden_size=128, max_sequence_length=64,
              hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5, use_bias=False,
              use_qkv_bias=True, model_parallel_size=1)
TRAIN_ARGS = ["--mode", "finetune", "--train-iters", "3", "--batch-size", "4", "--lr", "0.05",
              "--lr-decay-style", "constant", "--log-interval", "1", "--train-data", "synthetic", "--split", "1",
              "--seed", "1234", "--save-interval", "100000", "--eval-interval", "100000", "--num-workers", "0",
              "--experiment-name", "other-sat", "--no-save-rng"]


class FineTuneChatGLM2(ChatGLM2Model):
    """SAT's ChatGLM2 LoRA fine-tune model: LoRA (or QLoRA) added by the constructor itself."""

    def __init__(self, args, transformer=None, **kwargs):
        super().__init__(args, transformer=transformer, **kwargs)
        self.add_mixin("lora", LoraMixin(args.num_layers, args.lora_rank, layer_range=None,
                                         qlora=bool(getattr(args, "use_qlora", False))), reinit=True)

    def disable_untrainable_params(self):
        for name, p in self.named_parameters():
            p.requires_grad_("matrix_A" in name or "matrix_B" in name)

    @classmethod
    def add_model_specific_args(cls, parser):
        group = parser.add_argument_group("finetune")
        group.add_argument("--lora_rank", type=int, default=4)
        group.add_argument("--use_qlora", action="store_true")
        return super().add_model_specific_args(parser)


class LoraCogVLM(FineTuneTrainCogVLMModel):
    """A CogVLM fork's fine-tune class that adds LoRA to the language model in its constructor."""

    def __init__(self, args, transformer=None, **kwargs):
        super().__init__(args, transformer=transformer, **kwargs)
        self.add_mixin("lora", LoraMixin(args.num_layers, args.lora_rank, layer_range=None), reinit=True)


def write_base(path: str, seed: int = 0, **overrides) -> str:
    """A plain ChatGLM2Model checkpoint at model-parallel size 1, as released weights are saved."""
    from sat_patches.checkpoints import writer
    cfg = dict(CONFIG, **overrides)
    model = ChatGLM2Model(ChatGLM2Model.get_args(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    writer.write_layout(path, 1, {0: {"module": model.state_dict(), "iteration": 1}}, cfg)
    return path


_seen = {}


def forward_step(data_iterator, model, args, timers):
    """As SAT's ChatGLM2 example: the loss in float, returned in the model's dtype, and as a metric."""
    from sat import mpu
    timers("batch generator").start()
    data = next(data_iterator) if data_iterator is not None else None
    tokens = mpu.broadcast_data(["tokens"], data, torch.int64)["tokens"]
    timers("batch generator").stop()
    logits = model(input_ids=tokens)[0]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1)).to(logits.dtype)
    if not _seen:
        module = getattr(model, "module", model)
        _seen.update(loss=float(loss.detach().float()), mp=mpu.get_model_parallel_world_size(),
                     embedding_rows=module.transformer.word_embeddings.weight.shape[0],
                     nf4=sorted({type(m).__name__ for m in module.modules() if "4bit" in type(m).__name__
                                 or "NF4" in type(m).__name__}))
    _seen.setdefault("losses", []).append(float(loss.detach().float()))
    return loss, {"loss": loss}


def create_dataset(path, args):
    from tiny_lora import CountingDataset
    return CountingDataset()


def main(argv):
    """The script: ``get_args``, ``from_pretrained(path, args)`` (no ``overwrite_args``), ``training_main``."""
    from sat import get_args
    from sat.training.deepspeed_training import training_main
    py_parser = argparse.ArgumentParser(add_help=False)
    py_parser.add_argument("--from_pretrained", required=True)
    py_parser = FineTuneChatGLM2.add_model_specific_args(py_parser)
    known, rest = py_parser.parse_known_args(TRAIN_ARGS + list(argv))
    args = get_args(rest)
    args = argparse.Namespace(**vars(args), **vars(known))
    if args.use_qlora:
        args.device = "cpu"
    model, args = FineTuneChatGLM2.from_pretrained(args.from_pretrained, args)
    model = training_main(args, model_cls=model, forward_step_function=forward_step,
                          create_dataset_function=create_dataset)
    _seen["logits"] = logits(getattr(model, "module", model)).tolist()
    torch.distributed.barrier()
    return dict(_seen)


def logits(model, seq: int = 8) -> torch.Tensor:
    ids = (torch.arange(2 * seq).reshape(2, seq) * 7) % CONFIG["vocab_size"]
    pos = torch.arange(seq)[None].expand_as(ids)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, attention_mask=torch.ones(1, 1, seq, seq).tril())[0].float()

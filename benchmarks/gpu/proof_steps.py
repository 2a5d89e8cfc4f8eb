"""Parts a and b of the GPU proof: training steps of CogVLM and CogAgent at full size, measured beside the plan.

a. Full-size CogVLM-17B and CogAgent-18B, random bf16 weights built on the compute device through
   sat_patches' construction path, LoRA rank 10 (language model and EVA, as upstream's demo), activation
   checkpointing, the micro-batch ``sat-patches plan`` recommends for one 80 GB GPU: two training steps
   (forward, loss, backward, AdamW); ``max_memory_allocated`` beside the plan's per-GPU figure, step time.
   Then stock SAT's LoRA and step on the same kind of base (sat_patches removed after the base is built),
   side by side in the same process.
b. QLoRA as upstream's demo runs it: a full-size bf16 CogVLM checkpoint written to local disk once, loaded
   with ``--use_qlora`` (sat_patches' streamed NF4 loader), the NF4 weights compared with bitsandbytes' own
   quantisation of the same tensors, then two steps at the plan's micro-batch for one 24 GB GPU under
   ``torch.cuda.set_per_process_memory_fraction``.

With ``tiny`` the same code runs the tiny models on the CPU (micro-batch at most 2); CUDA-only figures
are skipped there.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import shutil
import time

from proof_record import Recorder, Skip, cuda, device, gb

MODELS = {"cogvlm": "cogvlm-base-490", "cogagent": "cogagent-chat"}
LORA_RANK = 10
TINY_MICRO_BATCH = 2
GPU_GB = {"a": 80, "b": 24}  # the plan's rows: one 80 GB GPU (part a), one 24 GB GPU with QLoRA (part b)


def tiny_config(kind: str) -> dict:
    from sat_patches.cogvlm.config import tiny_config as config
    return config(kind)


def full_config(kind: str) -> dict:
    from sat_patches.cogvlm.shapes import upstream_config
    return upstream_config(MODELS[kind])


def model_parallel() -> None:
    """SAT's process group and model-parallel groups at world size 1 (what ``from_pretrained`` sets up)."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    from sat_patches.checkpoints.loading import ensure_model_parallel
    ensure_model_parallel(argparse.Namespace(model_parallel_size=1, seed=1234))


def model_args(config: dict, dev):
    from sat_patches.cogvlm.config import _run_defaults
    from sat_patches.cogvlm.models import model_class_for
    cls = model_class_for(config["model_class"], finetune=False)
    args = cls.get_args()
    for key, value in {**_run_defaults(), **copy.deepcopy(config)}.items():
        setattr(args, key, value)
    args.skip_init, args.bf16, args.device = True, True, dev.type
    return cls, args


def build_model(config: dict, dev):
    """``(model, args)``: the model of ``config`` built on ``dev`` in bf16 through sat_patches'
    construction context, its weights random (normal, std 0.02; norms 1, biases 0)."""
    import torch
    from sat_patches.runtime import construction
    model_parallel()
    cls, args = model_args(config, dev)
    with construction.build_on(dev, torch.bfloat16):
        model = cls(args)
    randomise(model)
    return model, args


def randomise(model) -> None:
    """Random weights in place, the same rule for any stack: norms' weights 1, biases 0, every other
    parameter normal with std 0.02."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)


def add_lora(model, rank: int = LORA_RANK, eva: bool = True) -> None:
    """LoRA as upstream's demo adds it (language model, and EVA), with SAT's ``LoraMixin`` as it is now
    (sat_patches' or stock SAT's); only the LoRA factors train."""
    from sat.model.finetune.lora2 import LoraMixin
    model.add_mixin("lora", LoraMixin(len(model.transformer.layers), rank), reinit=True)
    if eva:
        vit = model.get_mixin("eva").vit_model
        vit.add_mixin("lora", LoraMixin(len(vit.transformer.layers), rank), reinit=True)
    for name, p in model.named_parameters():
        p.requires_grad_("matrix_" in name)


def checkpointing(model, on: bool = True) -> None:
    """``--checkpoint-activations --vit_checkpoint_activations`` (``on=False``: neither)."""
    model.transformer.checkpoint_activations = on
    model.get_mixin("eva").vit_model.transformer.checkpoint_activations = on


class _Real:
    """The values :func:`layer_bytes._inputs` (benchmarks/calibration) marks, as real tensors on ``dev``."""

    def __init__(self, dev):
        self.dev = dev

    def meta(self, tensor):
        return tensor.to(self.dev)


def batch_inputs(config: dict, tokens: int, batch: int, dev) -> dict:
    """One micro-batch as the data pipeline makes it (the layout the plan is calibrated on), pixels random."""
    import torch
    from layer_bytes import _inputs
    inputs = _inputs(_Real(dev), config, tokens, batch)
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            inputs[key] = torch.randn(value.shape, dtype=value.dtype, device=dev)
    return inputs


def train_steps(model, inputs: dict, vocab: int, steps: int = 2) -> dict:
    """``steps`` training steps (forward, loss over shifted tokens, backward, AdamW); the peak of
    ``max_memory_allocated`` over them (CUDA), each step's seconds and loss."""
    import torch
    dev = inputs["input_ids"].device
    labels = torch.randint(0, vocab, inputs["input_ids"].shape, device=dev)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    model.train()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(**inputs)[0].float()
        shift = logits[..., :-1, :].contiguous()
        loss = torch.nn.functional.cross_entropy(shift.view(-1, shift.size(-1)), labels[..., 1:].reshape(-1))
        del logits, shift
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))  # (a float of a tensor that requires grad: torch warns)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    return {"peak": peak, "seconds": seconds, "losses": losses, "trainable": sum(p.numel() for p in params)}


def plan_row(config: dict, gpu_gb: int, qlora: bool, tokens: int):
    """The plan's recommended option for one GPU of ``gpu_gb`` (the scripts' LoRA settings), and the bytes
    of it that PyTorch's allocator holds: the per-GPU figure less the CUDA context and DeepSpeed's ZeRO
    buckets (the proof's step uses plain AdamW, no DeepSpeed engine)."""
    from sat_patches.planning import search, shapes
    options = search.options(shapes.plan_config(config), 1, gpu_gb, qlora=qlora, train="lora", seq_len=tokens,
                           lora_rank=LORA_RANK)
    best = search.recommend(options) or min(options, key=lambda o: o.estimate.per_gpu)
    est = best.estimate
    allocated = est.per_gpu - est.device.get("CUDA context, NCCL, allocator", 0) - est.device.get("ZeRO buckets", 0)
    return best, allocated


def free() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def torch_rotary():
    """SAT's ``FastRotaryEmbedding`` on sat_patches' torch kernel instead of SAT's triton kernel."""
    from unittest import mock

    import sat.model.position_embedding.triton_rotary_embeddings as rotary_embeddings
    from sat_patches.kernels.rotary import apply_rotary
    with mock.patch.object(rotary_embeddings, "apply_rotary", apply_rotary):
        yield


def _step_row(rec: Recorder, label: str, config: dict, tokens: int, micro_batch: int, planned: float, build,
              after=None):
    """:func:`_one_step`; when it fails in SAT's triton rotary kernel (a triton release it was not written
    for), once more on the torch kernel, so that the memory and time figures still come."""
    row = _one_step(rec, label, config, tokens, micro_batch, planned, build, after)
    if row.status == "FAIL" and "triton" in row.detail.lower():
        with torch_rotary():
            row = _one_step(rec, f"{label} (torch rotary kernel: SAT's triton kernel failed above)", config, tokens,
                            micro_batch, planned, build, after)
    return row


def _one_step(rec: Recorder, label: str, config: dict, tokens: int, micro_batch: int, planned: float, build,
              after=None):
    """One model's step: ``build()`` gives the model ready to train, ``after()`` runs when the step is over
    (passed or failed); the row holds peak, plan and times."""
    import torch
    dev = device()
    expected = f"plan {gb(planned)} allocated" if cuda() else ""
    model = None
    with rec.check(label, expected=expected) as row:
        model = build()
        checkpointing(model)
        result = train_steps(model, batch_inputs(config, tokens, micro_batch, dev), config["vocab_size"])
        row.measured = f"step {result['seconds'][-1]:.2f} s (first {result['seconds'][0]:.2f} s)"
        row.detail = (f"micro-batch {micro_batch}, {tokens} tokens, {result['trainable'] / 1e6:.1f} M trainable, "
                      f"losses {', '.join(f'{x:.3f}' for x in result['losses'])}")
        if result["peak"] is not None:
            row.measured = f"max allocated {gb(result['peak'])} ({result['peak'] / planned:.2f}x plan); " + row.measured
        assert all(torch.isfinite(torch.tensor(result["losses"]))), result["losses"]
    model = None  # noqa: F841 (also when the step failed: the next model needs the memory)
    if after is not None:
        after()
    free()
    return row


def full_size_steps(rec: Recorder, tiny: bool) -> None:
    """Part a: sat_patches' steps of both models first, then stock SAT's (the slower builds)."""
    import sat_patches
    dev = device()
    runs = [_plan_for_part_a(rec, kind, tiny) for kind in MODELS]
    for config, name, tokens, micro_batch, planned in runs:
        def patched(config=config):
            model, _ = build_model(config, dev)
            add_lora(model)
            return model
        _step_row(rec, f"{name}: LoRA r={LORA_RANK} step, sat_patches (built on {dev.type})", config, tokens,
                  micro_batch, planned, patched)
    for config, name, tokens, micro_batch, planned in runs:
        _step_row(rec, f"{name}: LoRA r={LORA_RANK} step, stock SAT", config, tokens, micro_batch, planned,
                  lambda config=config: stock_model(config, dev), after=sat_patches.apply)


def _plan_for_part_a(rec: Recorder, kind: str, tiny: bool):
    """(config, name, tokens, micro-batch, planned allocated bytes) of ``kind``, with the plan's row recorded."""
    from sat_patches.planning.shapes import default_seq_len, plan_config
    config = tiny_config(kind) if tiny else full_config(kind)
    tokens = default_seq_len(plan_config(config))
    best, planned = plan_row(config, GPU_GB["a"], False, tokens)
    micro_batch = min(best.estimate.setup.micro_batch, TINY_MICRO_BATCH) if tiny else best.estimate.setup.micro_batch
    name = f"{MODELS[kind]}{' (tiny)' if tiny else ''}"
    with rec.check(f"{name}: the plan for 1 x {GPU_GB['a']} GB", expected="a recommended row") as row:
        row.measured = (f"micro-batch {best.estimate.setup.micro_batch}, {gb(best.estimate.per_gpu)} per GPU, "
                        f"{gb(planned)} of it allocated by PyTorch")
        row.detail = "; ".join(f"{k} {gb(v)}" for k, v in best.estimate.device.items())
    return config, name, tokens, micro_batch, planned


def stock_model(config: dict, dev):
    """The same base (built as above), then stock SAT's LoRA with sat_patches removed; moved and cast as SAT's
    ``training_main`` and DeepSpeed's bf16 engine do (``model.to(device)``, ``bfloat16()``). The caller
    applies the patches again when the step ends."""
    import sat_patches
    model, _ = build_model(config, dev)
    sat_patches.unpatch()
    try:
        add_lora(model)
        lora = {(str(p.device), str(p.dtype)) for n, p in model.named_parameters() if "matrix_" in n}
        print(f"stock SAT's LoRA factors were created on {sorted(lora)}", flush=True)
        return model.to(dev).bfloat16()
    except BaseException:
        sat_patches.apply()
        raise


# --------------------------------------------------------------------------------------
# Part b: QLoRA
# --------------------------------------------------------------------------------------

def qlora(rec: Recorder, tiny: bool, scratch: str) -> None:
    """Part b."""
    import torch
    from sat_patches.cogvlm.saving import save_pretrained_dir
    from sat_patches.planning.shapes import default_seq_len, plan_config
    dev = device()
    config = tiny_config("cogvlm") if tiny else full_config("cogvlm")
    tokens = default_seq_len(plan_config(config))
    best, planned = plan_row(config, GPU_GB["b"], True, tokens)
    micro_batch = min(best.estimate.setup.micro_batch, TINY_MICRO_BATCH) if tiny else best.estimate.setup.micro_batch
    path = os.path.join(scratch, "cogvlm-bf16")
    try:
        with rec.check("write a bf16 CogVLM checkpoint to local disk") as row:
            model, args = build_model(config, dev)
            save_pretrained_dir(model, args, path)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            row.measured = f"{gb(size)} at {path}"
            del model
            free()
        with rec.check(f"QLoRA: memory limited to one {GPU_GB['b']} GB GPU") as row:
            if not cuda():
                raise Skip("no CUDA")
            total = torch.cuda.get_device_properties(0).total_memory
            fraction = min(1.0, GPU_GB["b"] * 2 ** 30 / total)
            torch.cuda.set_per_process_memory_fraction(fraction)
            row.measured = f"set_per_process_memory_fraction({fraction:.3f}) of {gb(total)}"
        model = _qlora_load(rec, path, best, dev)
        if model is not None:
            _nf4_equals_bitsandbytes(rec, model, path)
            from sat_patches.cogvlm.trainer import add_lora as demo_add_lora
            _step_row(rec, f"QLoRA: 2 steps at the plan's micro-batch for 1 x {GPU_GB['b']} GB", config, tokens,
                      micro_batch, planned, lambda: _with_lora(model, demo_add_lora))
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if cuda():
            torch.cuda.set_per_process_memory_fraction(1.0)


def _with_lora(model, add):
    """``model`` with the demo's QLoRA adapters (added once: a step run again keeps them)."""
    if "lora" in model.mixins:
        return model
    add(model, argparse.Namespace(use_qlora=True, num_layers=len(model.transformer.layers), lora_rank=LORA_RANK,
                                  layer_range=None))
    for name, p in model.named_parameters():
        p.requires_grad_("matrix_" in name)
    return model


def _qlora_load(rec: Recorder, path: str, best, dev):
    """Upstream's demo with ``--use_qlora``: ``from_pretrained`` (sat_patches streams the linears into NF4)."""
    import torch
    from sat_patches.cogvlm.models import model_class_for
    from sat_patches.lora import layer as lora
    weights = {k: v for k, v in best.estimate.device.items() if k.startswith("weights")}
    expected = f"plan weights {gb(sum(weights.values()))}" if cuda() else ""
    holder = {}
    with rec.check("QLoRA: from_pretrained with --use_qlora (streamed NF4)", expected=expected) as row:
        cls = model_class_for("cogvlm")
        args = cls.get_args()
        args.bf16, args.mode, args.skip_init, args.use_qlora, args.use_lora = True, "finetune", True, True, False
        args.device = "cpu"  # as upstream's demo sets it for QLoRA; sat_patches keeps the model on the compute device
        if cuda():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model, _ = cls.from_pretrained(path, args)
        nf4 = [n for n, m in model.named_modules() if lora._is_nf4(m)]
        row.measured = f"{len(nf4)} NF4 linears on {next(model.parameters()).device}"
        if cuda():
            peak = torch.cuda.max_memory_allocated()
            row.measured += f"; peak {gb(peak)} during the load, {gb(torch.cuda.memory_allocated())} after"
        row.detail = "; ".join(f"{k} {gb(v)}" for k, v in weights.items())
        assert nf4, "no linear became NF4"
        holder["model"] = model
    return holder.get("model")


def _nf4_equals_bitsandbytes(rec: Recorder, model, path: str) -> None:
    """Some NF4 linears (first and last language layer, a vision expert) against bitsandbytes'
    ``quantize_4bit`` of the checkpoint's float weight, on the same device."""
    import torch
    import bitsandbytes.functional as bnbf
    from sat_patches.checkpoints.files import find_checkpoint
    from sat_patches.checkpoints.safe_load import load
    from sat_patches.lora import layer as lora
    with rec.check("QLoRA: NF4 weights == bitsandbytes' own quantisation", expected="codes and statistics equal") as row:
        nf4 = [(n, m) for n, m in model.named_modules() if lora._is_nf4(m)]
        picked = {name: m for name, m in nf4[:2] + nf4[-2:]}
        picked.update({n: m for n, m in nf4 if "vision" in n and len(picked) < 6})
        ckpt = find_checkpoint(path, None)
        state = load(ckpt.files[0])["module"]
        for name, layer in picked.items():
            weight = layer.weight
            float_weight = state[name + ".weight"].to(weight.device)
            packed, want = bnbf.quantize_4bit(float_weight, blocksize=weight.quant_state.blocksize, compress_statistics=True,
                                              quant_type="nf4", quant_storage=weight.dtype)
            got = weight.quant_state
            assert torch.equal(weight.data.view(-1), packed.view(-1)), f"{name}: 4-bit codes differ"
            assert torch.equal(got.absmax, want.absmax), f"{name}: absmax differs"
            assert torch.equal(got.offset, want.offset), f"{name}: offset differs"
            assert torch.equal(got.state2.absmax, want.state2.absmax), f"{name}: second-level absmax differs"
        row.measured = f"{len(picked)} linears equal ({', '.join(sorted(picked)[:3])}, ...)"
        del state

"""``sat-patches plan``: what fits a box (GPUs, their memory, host memory) for CogVLM / CogAgent, as a table, a
recommendation, the scripts' settings and a DeepSpeed config; the figures are :mod:`sat_patches.planning`'s."""
from __future__ import annotations

import json
from typing import List, Optional

from ..core.registry import VERIFIED_SAT
from ..planning.memory import GB
from ..planning.realise import checkpoint_options, deepspeed_config, script_settings
from ..planning.search import Option, _preference, options, recommend
from ..planning.shapes import MODELS, default_seq_len, model_parts, parameter_count, resolve_model
from ..planning.timing import CARDS, card, layer_states


def _gb(x: float) -> str:
    return f"{x / GB:6.1f}"


def checkpointing(s, layers: int) -> str:
    """The language model's ``layers`` by checkpointing (EVA's in the same shares), as the table's column says it:
    ``full 75% selective 25%``, ``full 90% none 10%``, ``none 100%``."""
    states = layer_states(layers, s.checkpoint_skip_layers, s.selective_share, s.checkpoint_activations)
    return " ".join(f"{state} {round(100 * states.count(state) / layers)}%" for state in ("full", "selective", "none")
                    if state in states)


def layer_path(s) -> str:
    """How the layers' bodies run: ``compiled`` (SAT_PATCHES_COMPILE_LAYERS=1) or ``eager``."""
    return "compiled" if s.compiled else "eager"


def format_plan(name: str, config: dict, opts: List[Option], best: Optional[Option], args) -> str:
    first = opts[0].estimate if opts else None
    s0 = first.setup if first else None
    lines = [f"sat-patches plan: {name} on {args.nodes} node(s) x {args.gpus} GPU(s) x {args.gpu_mem:g} GB"
             + (f", host {args.host_mem:g} GB per node" if args.host_mem else "")]
    if first:
        base = parameter_count(config)
        parts = ", ".join(f"{p.name} {p.total / 1e9:.2f} B" for p in model_parts(config) if not p.buffer)
        lines.append(f"model: {base / 1e9:.2f} B parameters ({parts}); LoRA rank {s0.lora_rank} adds "
                     f"{(first.params - base) / 1e6:.1f} M; trainable {first.trainable / 1e6:.1f} M "
                     f"({'LoRA' if s0.train == 'lora' else 'LoRA + upstream demo set'}), {s0.dtype}, "
                     f"max_length {s0.seq_len}")
    gpu, how = args.card
    hint = "" if how == "given" else "; --gpu NAME or --tflops N to set it"
    lines.append(f"card: {gpu.name}, {gpu.tflops:g} TFLOP/s bf16 ({how}{hint}): step "
                 f"time predicted from the useful FLOP, recomputed layers and a per-layer cost; the fastest setting "
                 f"that fits is shown per row (checkpointing: the language layers' shares, EVA's the same)")
    lines.append(" MP  ZeRO  offload  micro-batch  accumulation  global batch  checkpointing                    layers    "
                 "GB/GPU  host GB/node  stock-SAT host GB/node  step s  tokens/s")
    groups = {}
    for o in opts:
        s = o.estimate.setup
        groups.setdefault((s.qlora, s.mp, s.zero, s.offload), []).append(o)
    bf16_fits = any(o.viable for o in opts if not o.estimate.setup.qlora)
    qlora_fits = [o for o in opts if o.viable and o.estimate.setup.qlora]
    headed, layers = False, config["num_layers"]
    for (qlora, mp, zero, off), group in sorted(groups.items()):
        if qlora and bf16_fits:
            continue  # one screen: the QLoRA rows where nothing else fits, else one line below
        if qlora and not headed:
            lines.append("QLoRA (NF4 base, LoRA on the language model; EVA, embeddings and LM head in bf16):")
            headed = True
        fitting = [o for o in group if o.viable]
        o = max(fitting, key=lambda o: o.time.tokens_per_s) if fitting else min(group, key=lambda o: o.estimate.per_gpu)
        e = o.estimate
        verdict = "ok" if o.viable else f"no: {o.reason}"
        lines.append(f"{mp:3d}  {zero:4d}  {'cpu' if off else '-':>7}  {e.setup.micro_batch:11d}  "
                     f"{e.setup.accumulation:12d}  {e.setup.global_batch:12d}  {checkpointing(e.setup, layers):<31}  {layer_path(e.setup):<8}  {_gb(e.per_gpu)}  {_gb(e.host_node):>12}  "
                     f"{_gb(e.host_stock_node):>22}  {o.time.seconds:6.2f}  {o.time.tokens_per_s:8.0f}  {verdict}")
    if bf16_fits and qlora_fits:
        q = min(qlora_fits, key=_preference).estimate
        lines.append(f"QLoRA (QLORA=1) fits too: {q.per_gpu / GB:.1f} GB per GPU at MP_SIZE=1, micro-batch "
                     f"{q.setup.micro_batch} x accumulation {q.setup.accumulation} (an NF4 base; --json lists its "
                     f"rows)")
    if best is None:
        lines.append("recommendation: nothing fits" + ("" if opts else f": no MP size has data-parallel ranks that "
                                                        f"divide --global-batch {args.global_batch}") +
                     ". Add GPUs (a larger MP_SIZE divides the weights), use cards with more memory, or train fewer "
                     "parameters (--train lora, a smaller --max-length).")
        return "\n".join(lines)
    s, e = best.estimate.setup, best.estimate
    env = " ".join(f"{k}={v}" for k, v in script_settings(s).items())
    lines += [f"recommended: {'QLoRA (QLORA=1, --use_qlora), ' if s.qlora else ''}MP_SIZE={s.mp}, ZeRO-{s.zero}, "
              f"{'optimizer offload to CPU' if s.offload else 'no offload'},"
              f" global batch {s.global_batch} = micro-batch {s.micro_batch} x accumulation {s.accumulation} x "
              f"{s.dp} data-parallel ranks, checkpointing {checkpointing(s, layers)}, {layer_path(s)} layers: "
              f"{e.per_gpu / GB:.1f} GB per GPU, "
              f"{best.time.seconds:.2f} s per step, {best.time.tokens_per_s:.0f} tokens/s predicted, "
              f"host {e.host_node / GB:.0f} GB per "
              f"node with sat_patches (stock SwissArmyTransformer {VERIFIED_SAT} peaks near "
              f"{e.host_stock_node / GB:.0f} GB per node)",
              f"finetune script: {env}  (LOCAL_WORLD_SIZE also in .deepspeed_env); "
              + " ".join([f"--max_length {s.seq_len}", *checkpoint_options(s)]),
              "DeepSpeed config (--deepspeed_config): " + json.dumps(deepspeed_config(s))]
    return "\n".join(lines)


def cmd_plan(args) -> int:
    config = resolve_model(args.model)
    fields = dict(dtype=args.dtype, seq_len=args.max_length or default_seq_len(config), lora_rank=args.lora_rank,
                  train=args.train, checkpoint_activations=not args.no_checkpoint_activations)
    try:
        args.card = card(args.gpu, args.tflops, args.gpu_mem)
    except ValueError as e:
        raise SystemExit(f"sat-patches plan: {e}")
    opts = options(config, args.gpus, args.gpu_mem, args.host_mem, nodes=args.nodes, zero=args.zero,
                   offload=None if args.offload is None else args.offload == "cpu", micro_batch=args.micro_batch,
                   gpu=args.card[0], checkpoint_skip_layers=args.checkpoint_skip_layers,
                   global_batch=args.global_batch, selective=args.selective, **fields)
    best = recommend(opts)
    if args.json:
        gpu, how = args.card
        print(json.dumps({"model": args.model, "card": dict(name=gpu.name, tflops=gpu.tflops, chosen=how),
                          "options": [dict(o.estimate.as_dict(), viable=o.viable, reason=o.reason, **o.time.as_dict())
                                      for o in opts],
                          "recommended": None if best is None else dict(
                              best.estimate.as_dict(), **best.time.as_dict(), script=script_settings(best.estimate.setup),
                              options=checkpoint_options(best.estimate.setup),
                              deepspeed_config=deepspeed_config(best.estimate.setup))}, indent=1))
    else:
        print(format_plan(args.model, config, opts, best, args))
    return 0 if best else 1


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory per GPU and host for each MP/ZeRO/offload/micro-batch x accumulation, "
                                    "and a recommendation")
    p.add_argument("--model", required=True, help=f"{' | '.join(MODELS)}, or a checkpoint dir / model_config.json")
    p.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-mem", type=float, required=True, help="GB per GPU (e.g. 24, 80)")
    p.add_argument("--host-mem", type=float, default=None, help="GB of host RAM per node")
    p.add_argument("--lora-rank", type=int, default=10)
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=None, help="only this ZeRO stage")
    p.add_argument("--offload", choices=["none", "cpu"], default=None, help="only this optimizer placement")
    p.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="samples per optimizer step, kept whatever the split (default: upstream's, 4 per "
                        "data-parallel rank: micro-batch 4, no accumulation)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="only this micro-batch per GPU (gradient accumulation makes up the global batch)")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per sample incl. image tokens (upstream --max_length)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--train", choices=["lora", "demo"], default="lora",
                   help="lora: LoRA matrices only; demo: what upstream's finetune_demo trains besides LoRA")
    p.add_argument("--no-checkpoint-activations", action="store_true")
    p.add_argument("--checkpoint-skip-layers", type=int, default=None, metavar="N",
                   help="only this many last language layers left out of checkpointing (default: the fastest that fits)")
    p.add_argument("--selective", action="store_true", default=None,
                   help="also time selective checkpointing (layers keeping their matrix products' outputs; default: "
                        "on the cards where the GPU kit measured it faster)")
    p.add_argument("--gpu", default=None, help=f"the card, for the predicted step time: {', '.join(CARDS)} "
                                                "(default: the one nearest in memory to --gpu-mem)")
    p.add_argument("--tflops", type=float, default=None, help="the card's peak dense bf16 TFLOP/s, instead of --gpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

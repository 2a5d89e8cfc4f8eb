"""Part l of the GPU proof: the speed ladder. In one process on one card, the peer (the released model's HF code
with PEFT, as part p builds it) and our step with each lever added in turn, at the plan's settings:

1. routing: SAT + sat_patches (its expert routing and attention paths), every layer fully checkpointed;
2. layers unchecked: the plan's last layers left out of checkpointing;
3. selective: the plan's fastest setting with a share of the checkpointed layers checkpointed selectively
   (``plan --selective``, ``SAT_PATCHES_CHECKPOINT_SELECTIVE``), even where the plan prefers none;
4. compiled: rung 2 with each layer's vision-expert MLP and routed attention projections torch.compile'd
   (``SAT_PATCHES_COMPILE_LAYERS=1``; the selective checkpoint does not combine with it).

Each at the plan's micro-batch for 80 GB (memory capped to 80 GB with ``set_per_process_memory_fraction`` on a larger
card) and, on a card of another size, for the card's own size. Per rung: step time (median after the warm-up
steps), tokens/s, peak, useful-FLOP utilisation (of the card's measured bf16 matrix rate, part p's definition),
the ratio to the peer, and the plan's predicted time for one micro-batch beside the measured one. Every rung starts
from the same LoRA weights, so their first losses agree. Rows check, on a card, the plan within 10% of every measured
step and the targets on the peer (1.5x at 80 GB, 2.0x at 141 GB; utilisation 45% / 50%).

``--tiny`` (CPU): tiny models, micro-batch 2, the levers forced (half the layers unchecked, half of the rest
selective) so every rung runs its code path; the plan's figures are printed, not checked. Needs ``--hf-code DIR`` as
part p, otherwise the peer's rows are ``skipped`` and the ratios are left out.
"""
from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass, replace
from typing import Dict, List, Optional
from unittest import mock

import peer_figures as figures
from proof_record import Recorder, Skip, cuda, device, gb

CAP_GB = 80                     # the plan's setting every card runs (memory capped to it)
TARGETS = {80: (1.5, 0.45), 141: (2.0, 0.50)}   # card memory: (tokens/s over the peer, useful-FLOP utilisation)
PLAN_TOLERANCE = 0.10
RUNGS = ("routing", "layers unchecked", "selective", "compiled")
LEVER_SETTINGS = frozenset({"SAT_PATCHES_CHECKPOINT_SELECTIVE", "SAT_PATCHES_COMPILE_LAYERS"})
STEPS = {False: 4, True: 2}     # tiny?: steps per rung (the compiled rung: two more, its compilation warms up)


@dataclass
class Rung:
    name: str
    setup: object               # sat_patches.planning.memory.Setup (accumulation 1: one micro-batch a step)
    levers: Dict[str, str]      # the sat_patches settings it runs with


def rungs(config: dict, memory_gb: float, tiny: bool) -> List[Rung]:
    """Our rungs at the plan's settings for ``memory_gb`` (``tiny``: micro-batch 2, the levers forced)."""
    from sat_patches.planning import realise, search, shapes
    from sat_patches.planning.memory import Setup
    c = shapes.plan_config(config)
    layers = c["num_layers"]
    if tiny:
        base = Setup(micro_batch=2, seq_len=shapes.default_seq_len(c))
        unchecked = replace(base, checkpoint_skip_layers=layers // 2)
        selective = replace(unchecked, selective_share=0.5)
    else:
        plain = search.recommend(search.options(c, 1, memory_gb, selective=False, qlora=False))
        base = replace(plain.estimate.setup, accumulation=1, checkpoint_activations=True, checkpoint_skip_layers=0)
        unchecked = replace(plain.estimate.setup, accumulation=1)
        asked = search.options(c, 1, memory_gb, selective=True, qlora=False, micro_batch=base.micro_batch)
        # the plan's fastest setting with selective layers, even where it prefers none: the lever is measured
        asked = search.recommend([o for o in asked if o.estimate.setup.selective_share]) or plain
        selective = replace(asked.estimate.setup, accumulation=1)
    compiled = replace(unchecked, compiled=True)
    return [Rung("routing", base, {}), Rung("layers unchecked", unchecked, {}),
            Rung("selective", selective, realise.lever_settings(selective)),
            Rung("compiled", compiled, realise.lever_settings(compiled))]


def planned_seconds(config: dict, setup, memory_gb: float) -> float:
    """The plan's step for one micro-batch of ``setup`` on the card assumed from ``memory_gb``."""
    from sat_patches.planning import shapes, timing
    gpu, _ = timing.card(memory_gb=memory_gb)
    return timing.step_time(shapes.plan_config(config), setup, gpu.tflops).seconds


def set_checkpointing(model, config: dict, setup) -> None:
    """SAT's switches for ``setup``: checkpointing on or off, its last layers left out (EVA: the same share)."""
    from sat_patches.planning.timing import eva_skip_layers
    language, eva = model.transformer, model.get_mixin("eva").vit_model.transformer
    for transformer in (language, eva):
        transformer.checkpoint_activations = setup.checkpoint_activations
    language.checkpoint_skip_layers = setup.checkpoint_skip_layers
    eva.checkpoint_skip_layers = eva_skip_layers(setup.checkpoint_skip_layers, len(language.layers), len(eva.layers))


@contextlib.contextmanager
def levers_set(levers: Dict[str, str]):
    """The rung's sat_patches settings, and only those, in this process's environment while it runs (read at each
    call); the environment as it was afterwards."""
    with mock.patch.dict(os.environ, levers):
        for name in LEVER_SETTINGS.difference(levers):
            os.environ.pop(name, None)
        yield


def cap_memory(memory_gb: float) -> str:
    """Cap this process's CUDA memory at ``memory_gb`` (no cap off CUDA or on a card no larger)."""
    import torch
    if not cuda():
        return "no cap (CPU)"
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, memory_gb * 1e9 / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return f"{fraction:.3f} of {total / 1e9:.0f} GB"


def run(rec: Recorder, tiny: bool, hf_code) -> None:
    """Part l."""
    import proof_peer
    import proof_steps as steps
    import torch
    from sat_patches.planning.shapes import default_seq_len, plan_config
    dev = device()
    config = steps.tiny_config("cogvlm") if tiny else steps.full_config("cogvlm")
    tokens = default_seq_len(plan_config(config))
    useful = figures.useful_flops(config, tokens)
    own_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda() else CAP_GB
    sizes = [CAP_GB] + ([round(own_gb)] if abs(own_gb - CAP_GB) > 5 else [])
    with rec.check("bf16 matrix product on the device (what utilisation is measured against)") as row:
        peak_flops = proof_peer.matmul_flops_per_s(dev, tiny)
        row.measured = f"{peak_flops / 1e12:.3g} TFLOP/s"
    peer_missing = proof_peer.missing(hf_code)
    table: List[dict] = []
    for memory_gb in sizes:
        setting = f"plan for {memory_gb} GB"
        with rec.check(f"{setting}: memory cap") as row:
            row.measured = cap_memory(memory_gb)
        ladder = rungs(config, memory_gb, tiny)
        micro_batch = ladder[0].setup.micro_batch
        inputs = steps.batch_inputs(config, tokens, micro_batch, dev)

        def figures_of(stack, result):
            timed = result["seconds"][-2:] if len(result["seconds"]) > 2 else result["seconds"][1:] or result["seconds"]
            return figures.StepFigures(stack, setting, micro_batch, tokens, statistics.median(timed), result["peak"],
                                       useful, peak_flops, 0, result["trainable"])
        peer = None
        with rec.check(f"{setting}: peer (HF + PEFT), micro-batch {micro_batch}, every layer checkpointed") as row:
            if peer_missing:
                raise Skip(peer_missing)
            model, _ = proof_peer.hf_model(hf_code, config, dev)
            with proof_peer.checkpoint_each_layer(model):
                result = steps.train_steps(model, proof_peer.hf_inputs(inputs), config["vocab_size"], STEPS[tiny])
            del model
            steps.free()
            peer = figures_of(figures.PEER, result)
            row.measured = _said(peer)
            table.append(_line("peer (HF + PEFT)", peer, None, None, result["losses"]))
        _climb(rec, config, setting, memory_gb, ladder, inputs, tiny, figures_of, peer, table)
        steps.free()
    rec.extra["ladder_table"] = table
    rec.save()
    print("\n" + ladder_table(table) + "\n", flush=True)


def _climb(rec, config, setting, memory_gb, ladder, inputs, tiny, figures_of, peer, table) -> None:
    """Our model built once, each rung from the same LoRA weights."""
    import proof_steps as steps
    dev = inputs["input_ids"].device
    model, _ = steps.build_model(config, dev)
    steps.add_lora(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for rung in ladder:
        planned = planned_seconds(config, rung.setup, memory_gb)
        label = f"{setting}: {rung.name} ({checkpointing_of(config, rung.setup)}, {rung.setup.micro_batch} a step)"
        with rec.check(label, expected=f"plan {planned:.3f} s") as row:
            with levers_set(rung.levers):
                _restore(model, start)  # and the labels train_steps draws
                set_checkpointing(model, config, rung.setup)
                count = STEPS[tiny] + (2 if rung.setup.compiled else 0)
                result = steps.train_steps(model, inputs, config["vocab_size"], count)
            ours = figures_of(figures.OURS, result)
            row.measured = _said(ours) + (f", {ours.tokens_per_s / peer.tokens_per_s:.2f}x the peer" if peer else "")
            row.detail = "losses " + ", ".join(f"{x:.4f}" for x in result["losses"])
            table.append(_line(rung.name, ours, peer, planned, result["losses"]))
        if cuda() and row.status == "ok":
            _plan_check(rec, label, table[-1])
    del model
    if cuda() and peer is not None and table:
        _targets(rec, setting, memory_gb, table[-len(ladder):], peer)


def checkpointing_of(config: dict, setup) -> str:
    from sat_patches.cli.plan import checkpointing, layer_path
    from sat_patches.planning.shapes import plan_config
    return f"{checkpointing(setup, plan_config(config)['num_layers'])}, {layer_path(setup)}"


def _restore(model, start: dict) -> None:
    """The LoRA weights ``start`` holds, and the random state the labels are drawn from."""
    import torch
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in start:
                p.copy_(start[name])


def _said(f) -> str:
    return (f"step {f.seconds:.3f} s, {f.tokens_per_s:,.0f} tokens/s, {f.utilisation:.0%} useful-FLOP utilisation"
            + ("" if f.peak is None else f", peak {gb(f.peak)}"))


def _line(rung: str, f, peer, planned: Optional[float], losses) -> dict:
    return {"rung": rung, "setting": f.setting, "micro_batch": f.micro_batch, "seconds": f.seconds,
            "tokens_per_s": f.tokens_per_s, "peak": f.peak, "utilisation": f.utilisation,
            "ratio": f.tokens_per_s / peer.tokens_per_s if peer else None, "planned": planned,
            "first_loss": losses[0]}


def _plan_check(rec: Recorder, label: str, line: dict) -> None:
    with rec.check(f"{label}: the plan within {PLAN_TOLERANCE:.0%}", expected="measured / plan 0.90-1.10") as row:
        ratio = line["seconds"] / line["planned"]
        row.measured = f"{ratio:.2f}"
        assert abs(ratio - 1) <= PLAN_TOLERANCE, f"measured {line['seconds']:.3f} s, plan {line['planned']:.3f} s"


def _targets(rec: Recorder, setting: str, memory_gb: float, lines: List[dict], peer) -> None:
    speed, utilisation = TARGETS[min(TARGETS, key=lambda g: abs(g - memory_gb))]
    best = max(lines, key=lambda line: line["tokens_per_s"])
    with rec.check(f"{setting}: fastest rung ({best['rung']}) over the peer", expected=f">= {speed}x") as row:
        row.measured = f"{best['ratio']:.2f}x"
        assert best["ratio"] >= speed
    with rec.check(f"{setting}: fastest rung's useful-FLOP utilisation", expected=f">= {utilisation:.0%}") as row:
        row.measured = f"{best['utilisation']:.0%}"
        assert best["utilisation"] >= utilisation


def ladder_table(lines: List[dict]) -> str:
    """The ladder as a Markdown table (``proof.json`` keeps the rows under ``ladder_table``)."""
    out = ["| setting | rung | micro-batch | step | tokens/s | peak | utilisation | over the peer | plan "
           "| first loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in lines:
        out.append(f"| {x['setting']} | {x['rung']} | {x['micro_batch']} | {x['seconds']:.3f} s | "
                   f"{x['tokens_per_s']:,.0f} | {'-' if x['peak'] is None else gb(x['peak'])} | "
                   f"{x['utilisation']:.0%} | {'' if x['ratio'] is None else format(x['ratio'], '.2f') + 'x'} | "
                   f"{'' if x['planned'] is None else format(x['planned'], '.3f') + ' s'} | {x['first_loss']:.4f} |")
    return "\n".join(out)

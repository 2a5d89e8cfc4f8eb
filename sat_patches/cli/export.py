"""``sat-patches export hf CKPT OUT`` / ``export peft ADAPTER OUT`` / ``export diffusers RUN OUT`` and ``sat-patches
import hf HF_DIR OUT --mp N``: :mod:`sat_patches.export` (CogVideoX's: :mod:`sat_patches.checkpoints.cogvideo`) on the
command line. Errors print one line and exit 1 before anything is written.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sat-patches export",
                                description="CogVLM / CogAgent between SAT checkpoints and the Hugging Face layout; "
                                "CogVideoX's LoRA to diffusers'")
    sub = p.add_subparsers(dest="verb", required=True)
    hf = sub.add_parser("hf", help="SAT checkpoint -> Hugging Face folder (config.json, safetensors shards)")
    hf.add_argument("checkpoint", help="SAT checkpoint directory (any MP size, LoRA merged or not, adapter-only)")
    hf.add_argument("output", help="new folder for the Hugging Face layout")
    hf.add_argument("--max-shard-size", type=float, default=2000, metavar="MB",
                    help="largest safetensors shard, in MB (default 2000)")
    hf.add_argument("--hf-code", metavar="DIR", help="your local copy of the model's hub repository "
                    "(THUDM/cogvlm-chat-hf, cogagent-chat-hf): its .py files are copied for trust_remote_code, offline "
                    "(default: config.json's auto_map names the released repository's code)")
    peft = sub.add_parser("peft", help="a LoRA run's adapters -> PEFT adapter for the exported model")
    peft.add_argument("checkpoint", help="SAT checkpoint with LoRA matrices (an adapter-only save, or unmerged)")
    peft.add_argument("output", help="new folder for adapter_config.json and adapter_model.safetensors")
    peft.add_argument("--base-model", help="what adapter_config.json names as base_model_name_or_path "
                      "(the folder export hf wrote)")
    video = sub.add_parser("diffusers", help="a CogVideoX run's LoRA -> diffusers' CogVideoX LoRA (load_lora_weights)")
    video.add_argument("checkpoint", help="the run's folder (adapter-only or whole save, any MP size)")
    video.add_argument("output", help="new folder for pytorch_lora_weights.safetensors")
    video.add_argument("--lora-alpha", type=float, default=None,
                       help="the lora_config's lora_alpha (default: the run's training_config.yaml)")
    for verb in (hf, peft):
        verb.add_argument("--lora-alpha", type=float, default=1.0,
                          help="the LoraMixin lora_alpha used in training (SAT's and CogVLM's default: 1)")
    for verb in (hf, peft, video):
        verb.add_argument("--iteration", type=int, default=None, help="iteration to export (default: 'latest')")
    imp = sub.add_parser("import-hf", help="Hugging Face folder -> SAT checkpoint (from_pretrained, MODEL_TYPE=OUT)")
    imp.add_argument("hf_dir", help="Hugging Face folder of CogVLM or CogAgent (config.json, *.safetensors)")
    imp.add_argument("output", help="new SAT checkpoint directory")
    imp.add_argument("--mp", type=int, default=1, help="model-parallel size of the checkpoint (default 1)")
    for verb in (hf, peft, video, imp):
        verb.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (whole, at the end)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    a = parser().parse_args(argv)
    from ..checkpoints import cogvideo, files, safe_load  # torch and SAT: only once a conversion is asked for
    from ..export import hf, importer, peft  # (as above: the CLI starts without them)
    try:
        if a.verb == "hf":
            info = hf.export_hf(a.checkpoint, a.output, a.iteration, a.lora_alpha, int(a.max_shard_size * 10**6),
                                a.overwrite, a.hf_code)
            print(f"exported {info['model_class']} ({info['tensors']} tensors, {info['bytes'] / 1e9:.2f} GB in "
                  f"{info['shards']} shard(s), from {info['mp_size']} model-parallel shard(s), "
                  f"{info['lora_layers']} LoRA layer(s) folded) to {a.output}")
        elif a.verb == "diffusers":
            info = cogvideo.export_diffusers(a.checkpoint, a.output, a.iteration, a.lora_alpha, a.overwrite)
            print(f"exported the LoRA of {info['layers']} layer(s) ({info['tensors']} tensors, from {info['shards']} "
                  f"model-parallel shard(s), lora_alpha {info['alpha']:g} / r folded into lora_B) to {a.output}")
        elif a.verb == "peft":
            info = peft.export_peft(a.checkpoint, a.output, a.iteration, a.lora_alpha, a.overwrite, a.base_model)
            print(f"exported the LoRA of {info['layers']} layer(s) (rank {info['rank']}; {info['fused']} fused "
                  f"qkv/kv as one LoRA of rank partition x r) to {a.output}")
        else:
            info = importer.import_hf(a.hf_dir, a.output, a.mp, a.overwrite)
            print(f"imported {info['model_class']} ({info['tensors']} tensors) into {a.output} at model-parallel "
                  f"size {info['mp_size']}")
    except (files.CheckpointError, safe_load.UnsafeCheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def import_main(argv: Optional[List[str]] = None) -> int:
    """``sat-patches import hf HF_DIR OUT [--mp N]``: :func:`main`'s ``import-hf``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "hf":
        print("usage: sat-patches import hf HF_DIR OUT [--mp N] [--overwrite] (the Hugging Face layout is the one "
              "source there is)", file=sys.stderr)
        return 2
    return main(["import-hf", *argv[1:]])

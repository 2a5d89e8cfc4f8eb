#!/usr/bin/env bash
# Drop-in replacement for CogVLM's finetune_demo/finetune_cogvlm_lora.sh, with sat_patches applied.
#
# Settings come from the environment; the defaults are upstream's:
#   NUM_GPUS_PER_WORKER=8 MP_SIZE=1 NNODES=1 HOST_FILE= GLOBAL_BATCH= MICRO_BATCH= DS_CONFIG=zero2.json
#   MODEL_TYPE=cogvlm-base-490 MAX_LENGTH=1288 LORA_RANK=10 TRAIN_ITERS=800
# GLOBAL_BATCH (samples per optimizer step) empty: upstream's, DS_CONFIG's micro-batch x accumulation x
# data-parallel ranks (a resumed run's own). MICRO_BATCH, CHECKPOINT_SKIP_LAYERS empty: the fastest that
# `sat-patches plan` finds fitting the GPUs, else DS_CONFIG's micro-batch and every layer checkpointed;
# gradient accumulation makes up the global batch.
# Several machines: HOST_FILE (DeepSpeed over ssh); or on every node NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
# (torchrun); or srun --ntasks-per-node=1 bash finetune_cogvlm.sh (Slurm's variables).
# DS_CONFIG: zero2.json, zero2_offload.json, low_memory.json (installed with sat_patches) or a path.
# QLORA=1: upstream's --use_qlora instead of --use_lora (an NF4 base; needs MP_SIZE=1).
# RESUME=<run directory under SAVE_DIR> continues that run exactly; RESUME_ITERATION=N from its iteration N.
# EVALUATE=1: at the end the trained model answers every VALID_DATA sample (exact match; on by default on CPU).
# SAVE_ADAPTER_ONLY=1/0: saves hold the LoRA adapters only (megabytes; default when only LoRA trains) / the model.
# EXTRA_ARGS="..." adds options; DRY_RUN=1 prints the commands only; --help lists every setting.
# In a CogVLM checkout's finetune_demo/ it runs upstream's finetune_cogvlm_demo.py; elsewhere the
# standalone CogVLM of sat_patches. Without a GPU it trains a tiny CogVLM on 2 CPU ranks at MP_SIZE=2,
# merges the LoRA and the model-parallel shards into one MP=1 checkpoint and reloads it. In a checkout,
# CPU_RANKS=2 runs the checkout's own demo on 2 CPU ranks: a smoke test before paying for GPUs.
# Example, 2 GPUs with model parallelism:  NUM_GPUS_PER_WORKER=2 MP_SIZE=2 bash finetune_cogvlm.sh
export MODEL_KIND=cogvlm
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" exec python -m sat_patches.runner.finetune_run "$@"

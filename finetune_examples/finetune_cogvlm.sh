#!/usr/bin/env bash
# Drop-in replacement for CogVLM's finetune_demo/finetune_cogvlm_lora.sh, with sat_patches applied.
#
# Settings come from the environment; defaults are upstream's:
#   NUM_GPUS_PER_WORKER=8 MP_SIZE=1 NNODES=1 HOST_FILE= MODEL_TYPE=cogvlm-base-490 VERSION=base
#   MAX_LENGTH=1288 LORA_RANK=10 LAYER_RANGE= TRAIN_ITERS=800 TOKENIZER=lmsys/vicuna-7b-v1.5
#   TRAIN_DATA=./archive_split/train VALID_DATA=./archive_split/valid SAVE_DIR=./checkpoints
#   DS_CONFIG=zero2.json (zero2_offload.json, low_memory.json)  EXTRA_ARGS="..."  DRY_RUN=1
# In a CogVLM checkout's finetune_demo/ it runs upstream's finetune_cogvlm_demo.py; elsewhere our
# standalone CogVLM. Without a GPU it trains a tiny CogVLM on 2 CPU ranks at MP_SIZE=2, merges the
# LoRA and the model-parallel shards into one MP=1 checkpoint, reloads it and prints its answer.
# Example, 2 GPUs with model parallelism:  NUM_GPUS_PER_WORKER=2 MP_SIZE=2 bash finetune_cogvlm.sh
export MODEL_KIND=cogvlm
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" exec python -m sat_patches.tools.finetune_run "$@"

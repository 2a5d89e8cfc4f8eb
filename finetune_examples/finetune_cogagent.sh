#!/usr/bin/env bash
# Drop-in replacement for CogVLM's finetune_demo/finetune_cogagent_lora.sh, with sat_patches applied.
#
# Settings come from the environment; defaults are upstream's:
#   NUM_GPUS_PER_WORKER=8 MP_SIZE=1 NNODES=1 HOST_FILE= MODEL_TYPE=cogagent-chat VERSION=chat
#   MAX_LENGTH=400 (includes the 256 low-resolution image tokens) LORA_RANK=50 TRAIN_ITERS=2000
#   TOKENIZER=lmsys/vicuna-7b-v1.5 TRAIN_DATA=./archive_split/train VALID_DATA=./archive_split/valid
#   DS_CONFIG=zero2.json (zero2_offload.json, low_memory.json)  EXTRA_ARGS="..."  DRY_RUN=1
# Without a GPU it trains a tiny CogAgent (with its high-resolution cross branch) on 2 CPU ranks at
# MP_SIZE=2, merges LoRA and shards to MP=1, reloads it and prints its answer.
export MODEL_KIND=cogagent
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" exec python -m sat_patches.tools.finetune_run "$@"

#!/usr/bin/env bash
# Fine-tune Magistral-Small-2509 on 4 accelerators per node, AdamW moments in host memory (CUDA GPUs or Ascend NPUs: the trainer detects the device).
# Single node: bash examples/magistral-2509/finetune_4card.sh
# Multi-node and overrides: as in finetune_8card.sh, which this runs with the 4-card defaults.
set -euo pipefail

export NPUS_PER_NODE=${NPUS_PER_NODE:-4}
export CONFIG=${CONFIG:-examples/magistral-2509/config_4card.yaml}
export LOG_NAME=${LOG_NAME:-$(basename "$0" .sh)}  # logs/finetune_4card_<time>_node<rank>.log
exec bash "$(dirname "$0")/finetune_8card.sh" "$@"

#!/usr/bin/env bash
# Fine-tune Magistral-Small-2509 on 8 accelerators per node (CUDA GPUs or Ascend NPUs: the trainer detects the device).
# Single node: bash examples/magistral-2509/finetune_8card.sh
# Multi-node: set MASTER_ADDR to the first node's address, NNODES to the number of nodes and NODE_RANK per node.
# Extra arguments are config overrides, e.g. training.train_iters=100
# The console (every rank of this node) is also written to logs/<script>_<YYYYmmdd_HHMMSS>_node<NODE_RANK>.log;
# the script exits with torchrun's status (pipefail).
set -euo pipefail

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
CONFIG=${CONFIG:-examples/magistral-2509/config_8card.yaml}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}

LOG_NAME=${LOG_NAME:-$(basename "$0" .sh)}
cd "$(dirname "$0")/../.."
mkdir -p logs
LOG=logs/${LOG_NAME}_$(date +%Y%m%d_%H%M%S)_node${NODE_RANK}.log
echo "log: $LOG"
uv run torchrun \
  --nproc-per-node "$NPUS_PER_NODE" \
  --nnodes "$NNODES" \
  --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" \
  --master-port "$MASTER_PORT" \
  apps/train "$CONFIG" "$@" 2>&1 | tee -i "$LOG"  # -i: Ctrl-C stops torchrun, tee keeps its last words

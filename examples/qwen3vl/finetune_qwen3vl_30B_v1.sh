#!/usr/bin/env bash
# Fine-tune Qwen3-VL-30B-A3B-Instruct on 16 accelerators per node (Ascend NPUs or CUDA GPUs: the trainer detects the
# device). Walk-through: examples/qwen3vl/README.md.
# Single node:  bash examples/qwen3vl/finetune_qwen3vl_30B_v1.sh
# Multi-node:   on each node MASTER_ADDR=<first node> NNODES=<nodes> NODE_RANK=<0..nodes-1> bash ...
# Extra arguments are config overrides, e.g. training.train_iters=100; CONFIG picks another YAML (the LoRA recipe).
# The log goes to $LOG_DIR (default logs/ in the repository root) as finetune_qwen3vl_30B_v1_<date>.log.
set -euo pipefail

NPUS_PER_NODE=${NPUS_PER_NODE:-16}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
CONFIG=${CONFIG:-examples/qwen3vl/qwen3vl_30B_config_v1.yaml}
LOG_DIR=${LOG_DIR:-logs}

# Ascend: the CANN environment, when it is installed and not yet loaded
ASCEND_SET_ENV=${ASCEND_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
if [ -z "${ASCEND_TOOLKIT_HOME:-}" ] && [ -f "$ASCEND_SET_ENV" ]; then
  set +u
  # shellcheck disable=SC1090
  source "$ASCEND_SET_ENV"
  set -u
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}

cd "$(dirname "$0")/../.."
mkdir -p "$LOG_DIR"
LOG_FILE="$LOG_DIR/finetune_qwen3vl_30B_v1_$(date +%Y%m%d_%H%M%S).log"
echo "logging to $LOG_FILE"
uv run torchrun \
  --nproc-per-node "$NPUS_PER_NODE" \
  --nnodes "$NNODES" \
  --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" \
  --master-port "$MASTER_PORT" \
  apps/train "$CONFIG" "$@" 2>&1 | tee "$LOG_FILE"

#!/usr/bin/env bash
# Train with titanlite.  ./run_train.sh [--job.config_file X.toml] [--section.key value ...]
#   NGPU=N        processes on this node (default: all visible GPUs, or 1 on a machine without any)
#   LOG_RANK=0,1  ranks whose output is shown (torchrun --local-ranks-filter)
#   TORCHRUN_ARGS extra torchrun arguments, e.g. for several nodes:
#                 TORCHRUN_ARGS="--nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint HOST:29500"
set -eu
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if ! "$PY" -c "import titanlite" >/dev/null 2>&1; then
  echo "titanlite is not installed: running pip install -e . first" >&2
  "$PY" -m pip install -q -e . || { echo "error: pip install -e . failed" >&2; exit 2; }
fi

ARGS=("$@")
case " $* " in
  *" --job.config_file"*|*" -h "*|*" --help "*) ;;
  *) ARGS=(--job.config_file train_configs/debug_model.toml "${ARGS[@]}") ;;
esac

if [ -z "${NGPU:-}" ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${NGPU:-0}" -ge 1 ] || NGPU=1
fi
NNODES=1
if [[ "${TORCHRUN_ARGS:-}" =~ --nnodes[=\ ]([0-9]+) ]]; then NNODES=${BASH_REMATCH[1]}; fi

# Expandable segments: reserved GPU memory stays within a fraction of a percent of allocated (1.36B:
# 28.90 vs 28.82 GiB), which estimation's fit rule assumes. A setting of your own wins.
if [ -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
fi

# A bad option costs a second and one line (exit 2), not a process-group start-up.
"$PY" -m titanlite.config.check --world-size $((NGPU * NNODES)) "${ARGS[@]}"

if [ "$NGPU" -eq 1 ] && [ "$NNODES" -eq 1 ]; then
  exec "$PY" -m titanlite.train "${ARGS[@]}"
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec "$PY" -m torch.distributed.run --nproc_per_node="$NGPU" ${TORCHRUN_ARGS:---standalone} \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 -m titanlite.train "${ARGS[@]}"

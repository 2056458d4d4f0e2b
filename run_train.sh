#!/usr/bin/env bash
# Train with titanlite.  ./run_train.sh [--job.config_file X.toml] [--section.key value ...]
# Runs from any folder: every relative path (the config file, job.dump_folder, training.dataset_path,
# checkpoint paths; on the command line or inside the TOML) is relative to the folder you run it from.
# A config file not found there is looked up in this repository, so train_configs/... works anywhere.
#   NGPU=N        processes on this node (default: all visible GPUs, or 1 on a machine without any); at most
#                 one per GPU, or one per CPU core on a node without a GPU
#   LOG_RANK=0,1  local ranks of this node whose output is shown (torchrun --local-ranks-filter; default 0)
#   TORCHRUN_ARGS extra torchrun arguments, e.g. for several nodes:
#                 TORCHRUN_ARGS="--nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint HOST:29500"
#                 (one node count: an elastic MIN:MAX is refused)
#   PYTHON        the interpreter (default python3). What it lacks of pyproject.toml's dependencies is
#                 installed first (pip install -e this repository), torch before the rest:
#   TITANLITE_INSTALL=0  use the interpreter as it is: no check, no pip (an offline machine set up by hand);
#                 =only: install what is missing, then stop (run_tests.sh)
#   TORCH_SPEC    pip arguments that install torch when it is missing, e.g.
#                 TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128".
#                 Default: PyPI's torch on a machine with an NVIDIA GPU; otherwise a CPU build (one your pip
#                 configuration offers, else PyTorch's CPU index), never the CUDA build's GBs of libraries.
set -eu
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
# This checkout's code runs, whatever titanlite the interpreter has installed (or none).
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)  # NVIDIA GPUs on this node (0 without a driver)

fail() { echo "error: $*" >&2; exit 2; }

install_torch() {
  local spec
  if [ -n "${TORCH_SPEC:-}" ]; then
    read -r -a spec <<< "$TORCH_SPEC"
  elif [ "${GPUS:-0}" -ge 1 ]; then
    spec=(torch)
  else
    local cpu  # the newest CPU build among the versions pip's configured sources offer
    cpu=$("$PY" -m pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' | tr ',' '\n' \
          | tr -d ' ' | grep '+cpu$' | head -1 || true)
    if [ -n "$cpu" ]; then spec=("torch==$cpu"); else spec=(torch --index-url https://download.pytorch.org/whl/cpu); fi
  fi
  echo "run_train.sh: installing torch: pip install ${spec[*]}" >&2
  "$PY" -m pip install "${spec[@]}" || fail "pip install ${spec[*]} failed (see above); TORCH_SPEC sets the pip arguments that install torch here"
}

install_missing() {
  local lacking
  lacking=$("$PY" -m titanlite.tools.missing_deps "$REPO/pyproject.toml") && return 0
  [ -n "$lacking" ] || fail "$PY cannot run titanlite.tools.missing_deps (is it Python >= 3.10?)"
  echo "run_train.sh: $PY lacks: $lacking" >&2
  "$PY" -m pip --version >/dev/null 2>&1 || fail "$PY has no pip to install them with ($PY -m ensurepip adds it)"
  if [[ " $lacking " == *" torch"[\ \>=]* ]]; then install_torch; fi
  echo "run_train.sh: installing titanlite and its dependencies: pip install -e $REPO" >&2
  "$PY" -m pip install -e "$REPO" || fail "pip install -e $REPO failed (see above); TITANLITE_INSTALL=0 runs $PY as it is"
  lacking=$("$PY" -m titanlite.tools.missing_deps "$REPO/pyproject.toml") || fail "$PY still lacks $lacking after pip's install"
}

[ "${TITANLITE_INSTALL:-1}" = 0 ] || install_missing
[ "${TITANLITE_INSTALL:-1}" != only ] || exit 0

ARGS=("$@")
case " $* " in
  *" --job.config_file"*|*" -h "*|*" --help "*) ;;
  *) ARGS=(--job.config_file "$REPO/train_configs/debug_model.toml" "${ARGS[@]}") ;;
esac

if [ -n "${NGPU:-}" ]; then
  [[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || fail "NGPU must be a positive number of processes on this node; got '$NGPU'"
else
  NGPU=$GPUS
  [ "${NGPU:-0}" -ge 1 ] || NGPU=1
fi
NNODES=1
if [[ "${TORCHRUN_ARGS:-}" =~ --nnodes[=\ ]([^ ]+) ]]; then
  NNODES=${BASH_REMATCH[1]}
  # torchrun's elastic MIN:MAX: the world size, and with it the batch split and the checks made for it,
  # would be known only once the nodes have joined; a fixed count N:N is N
  if [[ "$NNODES" =~ ^([0-9]+):([0-9]+)$ ]]; then
    [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] || fail "TORCHRUN_ARGS --nnodes $NNODES: an elastic node count is not supported (the global batch, its accumulation and the checks before start-up are made for one world size); give one count, --nnodes ${BASH_REMATCH[2]}"
    NNODES=${BASH_REMATCH[1]}
  fi
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || fail "TORCHRUN_ARGS --nnodes expects a number of nodes; got '$NNODES'"
fi

# Expandable segments: reserved GPU memory stays within a fraction of a percent of allocated, which
# estimation's fit rule assumes. A setting of your own wins.
if [ -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
fi

# titanlite.launch checks the options first (a bad one costs a second and one line, exit 2, not a
# process-group start-up), predicts the peak memory per GPU beside the ranks' start-up
# (training.memory_fit), and ends a failed job in one line with its exit code.
# It prints the one command the job is: torchrun's (run inside titanlite.launch) or, for one process
# on one node, python -m titanlite.train's.
if [ "$NGPU" -eq 1 ] && [ "$NNODES" -eq 1 ]; then
  exec "$PY" -m titanlite.launch --world-size 1 --command "$0" --log-ranks "${LOG_RANK:-0}" -- "${ARGS[@]}"
fi
exec "$PY" -m titanlite.launch --world-size $((NGPU * NNODES)) --command "$0" --nodes "$NNODES" \
  --log-ranks "${LOG_RANK:-0}" --nproc_per_node="$NGPU" ${TORCHRUN_ARGS:---standalone} --role rank --tee 3 \
  -- "${ARGS[@]}"

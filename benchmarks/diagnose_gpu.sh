#!/usr/bin/env bash
# GPU acceptance for titanlite.diagnose: LLaMA 1.36B at 1, 2 and 4 GPUs, clean (expected verdict
# healthy, efficiency reported), and with a compute stall injected on every rank at 4 GPUs
# (expected verdict compute_stall). Needs 4 GPUs (H100/H200 80+ GB). About 6 minutes.
#   bash benchmarks/diagnose_gpu.sh            # writes under $OUT (default outputs/diagnose_gpu)
# Same per-GPU work everywhere (weak scaling): local batch 8 x 4 accumulation steps x seq 2048.
# DDP (not FSDP) so the exposed gradient communication is measured on its own.
set -eu
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TITANLITE_INSTALL=0  # the GPU machine has no network: no pip
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the lent machines have no NVLink multicast
OUT=${OUT:-outputs/diagnose_gpu}
STEPS=${STEPS:-30}
mkdir -p "$OUT/runs"
COMMON=(--job.config_file train_configs/llama_1.36b_h100.toml --training.steps "$STEPS" --metrics.log_freq 5
        --training.dataset synthetic --parallelism.data_parallel ddp --compile.enable=false
        --training.local_batch_size 8 --metrics.progress_bar=false --validation.enable=false --checkpoint.enable=false)
STALL=(--debug.inject_compute_matmuls "${MATMULS:-100}" --debug.inject_matmul_size 8192)  # ~+50% compute per micro-step

run() {  # run NAME NGPU [extra options]
  local name=$1 n=$2; shift 2
  local cmd=(env NGPU="$n" ./run_train.sh "${COMMON[@]}" --training.global_batch_size $((8 * 4 * n))
             --job.dump_folder "$OUT/runs/$name" "$@")
  echo "${cmd[*]}" >> "$OUT/COMMANDS.txt"
  echo "== $name ($n GPUs)"
  "${cmd[@]}" > "$OUT/runs/$name.log" 2>&1 || { tail -30 "$OUT/runs/$name.log"; exit 1; }
  tail -1 "$OUT/runs/$name.log"
}

: > "$OUT/COMMANDS.txt"
run clean_1 1
run clean_2 2
run clean_4 4
run stall_4 4 "${STALL[@]}"

log() { ls "$OUT/runs/$1"/run_*.json | tail -1; }
for report in "clean:clean_1 clean_2 clean_4" "stall:clean_1 clean_2 stall_4"; do
  name=${report%%:*}; logs=()
  for r in ${report#*:}; do logs+=("$(log "$r")"); done
  echo "python -m titanlite.diagnose ${logs[*]} --out $OUT/$name" >> "$OUT/COMMANDS.txt"
  python -m titanlite.diagnose "${logs[@]}" --out "$OUT/$name" || true
done
echo "expected: clean -> healthy, stall -> compute_stall"
grep -h '"verdict"' "$OUT"/clean/report.json "$OUT"/stall/report.json

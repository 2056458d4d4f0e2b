#!/bin/bash
# 1 -> 2 -> 4 GPU weak-scaling study (identical per-GPU work: local batch 4 x seq 2048, accumulation 1)
# for ddp / fsdp / zero1, the peer at 1 and the largest world size in the same call, an injected
# compute stall at the largest size, and titanlite.diagnose reports over both series.
#   OUT=DIR bash benchmarks/scaling_study.sh [NGPUS="1 2 4"] [MODEL=llama]
# Run from the repo root on the GPU machine, with .bench (the peer) and .whl carried.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/scaling}
NGPUS=${NGPUS:-"1 2 4"}
STEPS=${STEPS:-25}
MAX=${NGPUS##* }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for n in $NGPUS; do
  if [ "$n" = 1 ]; then
    python3 benchmarks/compare_peer.py --suite h100 --only compile --ngpus 1 --peer --steps "$STEPS" --skip 10 \
      --out "$OUT/g1" | tee "$OUT/table_g1.txt"
  else
    PEER=""; [ "$n" = "$MAX" ] && PEER="--peer --peer-modes fsdp,ddp"
    python3 benchmarks/compare_peer.py --suite scaling --ngpus "$n" $PEER --steps "$STEPS" --skip 10 \
      --out "$OUT/g$n" | tee "$OUT/table_g$n.txt"
  fi
done
# The same 1.36B DDP run at the largest size, with every rank doing 60 extra 8192^3 bf16 matmuls a micro-step.
python3 -m torch.distributed.run --standalone --nproc_per_node="$MAX" -m titanlite.train \
  --model.flavor 1.36B --training.seq_len 2048 --training.dataset synthetic --training.local_batch_size 4 \
  --compile.enable --parallelism.data_parallel ddp --training.steps "$STEPS" --metrics.log_freq 5 \
  --lr_scheduler.warmup_steps 10 --validation.enable=false --metrics.progress_bar=false \
  --debug.inject_compute_matmuls 60 --debug.inject_matmul_size 8192 --job.dump_folder "$OUT/stall" > "$OUT/stall.log" 2>&1
tail -2 "$OUT/stall.log"
last() { ls "$1"/run_*.json 2>/dev/null | grep -v _config | tail -1; }
CLEAN=( "$(last "$OUT/g1/compile_1gpu")" )
for n in $NGPUS; do [ "$n" = 1 ] || CLEAN+=( "$(last "$OUT/g$n/ddp_${n}gpu")" ); done
STALL=( "${CLEAN[@]:0:${#CLEAN[@]}-1}" "$(last "$OUT/stall")" )
python3 -m titanlite.diagnose "${CLEAN[@]}" --out "$OUT/diagnose_clean" | head -5
python3 -m titanlite.diagnose "${STALL[@]}" --out "$OUT/diagnose_stall" | head -5

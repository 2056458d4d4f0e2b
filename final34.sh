set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
A="--steps 25 --skip 10"
git log --oneline -1
if [ "${PART:-a}" = a ]; then
python3 benchmarks/compare_peer.py --only compile --ngpus 1 --peers 0.2.2 $A --out $OUT/one 2>&1 | tail -2
python3 benchmarks/compare_peer.py --suite scaling --only "ddp,fsdp" --ngpus 2 --peers 0.2.2 --peer-modes fsdp,ddp $A --out $OUT/two 2>&1 | tail -2
else
python3 benchmarks/compare_peer.py --suite scaling --only fsdp --ngpus 2 --peers 0.3.0 $A --out $OUT/v030 2>&1 | tail -2
fi
for d in $OUT/*/; do grep -h "^| [a-zt]" $d/compare_peer.md | grep -v "^| config"; done

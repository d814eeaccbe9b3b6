#!/usr/bin/env bash
# Two GPUs: the fused kernel's GPU test (peers' rows pushed into each rank's slots), then
# decode at tp2-symm-mem with the kernel pulling peers' rows (.carry/pull, the first
# version) and pushing them (this checkout), alternating, qwen3-8b then nemotron-h-8b.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 150 python -m pytest -q -x tests/test_symm_mem.py 2>&1 | tail -15 | tee $OUT/symm_test.log
grep -q " passed" $OUT/symm_test.log && ! grep -q failed $OUT/symm_test.log || exit 1
for round in 1 2; do
  for side in pull push; do
    if [ $side = pull ]; then P=/tmp/site:$PWD/.carry/pull; else P=/tmp/site:$PWD; fi
    echo "=== $side $round"
    PYTHONPATH=$P timeout 100 python bench/bench_tp.py --configs tp2-symm-mem --parts decode 2>&1 | grep -E "^tp2-symm-mem +[0-9]+ +[0-9.]+ " | head -3
    PYTHONPATH=$P timeout 100 python bench/bench_hybrid.py --configs tp2-symm-mem --parts decode 2>&1 | grep -E "^tp2-symm-mem +[0-9]+ +[0-9.]+ " | head -3
  done
done
cp bench/results/bench_tp.json bench/results/bench_hybrid.json $OUT/

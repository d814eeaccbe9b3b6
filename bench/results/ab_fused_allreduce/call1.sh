#!/usr/bin/env bash
# Two GPUs: the fused all-reduce + add + RMSNorm kernel's GPU test, then qwen3-8b and
# nemotron-h-8b decode at tp1, tp2 (NCCL, unfused) and tp2-symm-mem (the fused kernel).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 150 python -m pytest -q -x tests/test_symm_mem.py 2>&1 | tail -15 | tee $OUT/symm_test.log
grep -q " passed" $OUT/symm_test.log && ! grep -q failed $OUT/symm_test.log || exit 1
timeout 240 python bench/bench_tp.py --configs tp1 tp2 tp2-symm-mem --parts decode > $OUT/tp.log 2>&1
grep -E "^ *tp[12]|/ tp1|Error|error" $OUT/tp.log | tail -12
timeout 170 python bench/bench_hybrid.py --configs tp1 tp2 tp2-symm-mem --parts decode > $OUT/hybrid.log 2>&1
grep -E "^ *tp[12]|/ tp1|Error|error" $OUT/hybrid.log | tail -12
cp bench/results/bench_tp.json bench/results/bench_hybrid.json $OUT/

#!/usr/bin/env bash
# Two GPUs: why tp2-symm-mem stalled with prefetch on: the fused kernel's GPU test with a
# prefetch, then one tp2-symm-mem decode run with the prefetch, its workers' output kept.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python -m pytest -q -x tests/test_symm_mem.py 2>&1 | tail -25 | tee $OUT/symm_test.log
export BCG_PF_AR_MB=12 BCG_PF_ROT_MB=0 BCG_PF_NORM_MB=0
timeout 90 python bench/bench_tp.py --configs tp2-symm-mem --parts decode > $OUT/tp_ar.log 2>&1
tr '\r' '\n' < $OUT/tp_ar.log | grep -v "^ *$" | grep -v capturing | tail -25

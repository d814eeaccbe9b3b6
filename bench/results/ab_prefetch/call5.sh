#!/usr/bin/env bash
# Two GPUs: line-by-line L2 prefetch (prefetch.global.L2, not the bulk one that stalled the
# fused all-reduce kernel): the symmetric-memory GPU test with a prefetch, then qwen3-8b
# decode at tp1 and tp2-symm-mem, prefetch off and on, alternating.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 70 python -m pytest -q -x tests/test_symm_mem.py 2>&1 | tail -3 | tee $OUT/symm_test.log
grep -q "passed" $OUT/symm_test.log || exit 1
for round in 1 2; do
  for side in off on; do
    if [ $side = on ]; then export BCG_PF_AR_MB=12 BCG_PF_ROT_MB=16 BCG_PF_NORM_MB=4; else export BCG_PF_AR_MB=0 BCG_PF_ROT_MB=0 BCG_PF_NORM_MB=0; fi
    echo "=== $side $round"
    timeout 110 python bench/bench_tp.py --configs tp1 tp2-symm-mem --parts decode > $OUT/tp_${side}_${round}.log 2>&1
    grep -E "^ *(tp1|tp2-symm-mem) +[0-9]+ " $OUT/tp_${side}_${round}.log | head -6
  done
done

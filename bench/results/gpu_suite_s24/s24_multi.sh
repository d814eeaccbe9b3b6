#!/usr/bin/env bash
# Session 24, two GPUs: the GPU suite's several-GPU files (every MoE layout, all-to-all
# included), then qwen3-30b-a3b tp2 decode before (main at 32cba63 in .carry/before) and after.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
PYTHONPATH=/tmp/site:$PWD timeout 400 python3 -m pytest tests/test_symm_mem.py tests/test_multi_gpu.py \
  -k "symm_mem or tiny" -q -p no:cacheprovider -rs --tb=short > $OUT/multi.log 2>&1
tail -6 $OUT/multi.log
for side in before after; do
  if [ $side = before ]; then P=/tmp/site:$PWD/.carry/before; else P=/tmp/site:$PWD; fi
  echo "=== $side"
  PYTHONPATH=$P timeout 120 python bench/bench_moe.py --configs tp2 --parts decode 2>&1 | grep -E "^ *tp2 |tp2:|Error" | tail -5
done

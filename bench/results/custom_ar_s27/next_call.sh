#!/bin/bash
# For the next session (two GPUs): what session 27 could not finish for the custom
# all-reduce (its final kernel, without the deadline, and the tiny models with the flag).
# Every log goes to $OUT whole (session 27 lost the failing tests' reasons to a truncated
# tail).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpus.txt
timeout 240 python -m pytest -q -rA tests/test_custom_all_reduce.py -p no:faulthandler \
    -o faulthandler_timeout=100 > $OUT/custom.log 2>&1; echo "custom rc $?"
timeout 300 python -m pytest -q -rA tests/test_multi_gpu.py -k "tiny-qwen3-tp2 or second_engine" \
    > $OUT/multi.log 2>&1; echo "multi rc $?"
tail -3 $OUT/custom.log $OUT/multi.log

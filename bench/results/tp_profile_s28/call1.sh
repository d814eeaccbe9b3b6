#!/bin/bash
# Session 28, call 1 (two GPUs): the final custom all-reduce's tests, its latency beside
# NCCL's, and rank 0's kernels of a qwen3-8b decode step at tp1 / tp2 / tp2-custom.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpus.txt
timeout 150 python -m pytest -q -rA tests/test_custom_all_reduce.py -p no:faulthandler \
    > $OUT/custom.log 2>&1; echo "custom rc $?"; tail -2 $OUT/custom.log
timeout 120 python bench/bench_all_reduce.py > $OUT/all_reduce.log 2>&1; echo "ar rc $?"
cp bench/results/bench_all_reduce.json $OUT/ 2>/dev/null; grep -A16 "µs per call" $OUT/all_reduce.log
timeout 240 python bench/results/tp_profile_s28/profile_tp.py tp1 tp2-custom tp2 > $OUT/profile.log 2>&1
echo "profile rc $?"; grep -v "^\[" $OUT/profile.log | grep -E "==|us avg" | head -90

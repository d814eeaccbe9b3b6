#!/bin/bash
# Session 27, call 1 (two GPUs): the custom all-reduce's GPU tests, then qwen3-8b decode at
# tp1 / tp2 (custom, the default) / tp2-nccl / tp2-symm-mem side by side.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT
timeout 120 python -m pytest -q -x tests/test_kernels_all_reduce_norm.py 2>&1 | tail -3
timeout 240 python -m pytest -q -x tests/test_custom_all_reduce.py -rs 2>&1 | tail -25
timeout 120 python -m pytest -q -x tests/test_symm_mem.py 2>&1 | tail -3
timeout 330 python bench/bench_tp.py --configs tp1 tp2 tp2-nccl tp2-symm-mem --parts decode --repeats 1 2>&1 | grep -v "^\[" | tail -30
cp bench/results/bench_tp.json $OUT/ 2>/dev/null

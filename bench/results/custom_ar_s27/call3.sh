#!/bin/bash
# Session 27, call 3 (two GPUs): the custom all-reduce that gives up waiting after the
# timeout (no trap) through its tests, torch symm-mem's, and tiny split runs.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python -m pytest -q tests/test_kernels_all_reduce_norm.py 2>&1 | tail -1
timeout 150 python -m pytest -q -rf tests/test_custom_all_reduce.py -p no:faulthandler > /tmp/car.log 2>&1
echo "rc $?"; grep "passed\|failed\|FAILED\|gave up\|rank 0:\|rank 1 failed\|Error" /tmp/car.log | cut -c1-300 | tail -12
timeout 60 python -m pytest -q tests/test_symm_mem.py 2>&1 | tail -1
timeout 150 python -m pytest -q tests/test_multi_gpu.py -k "tiny-qwen3-tp2 or second_engine" -p no:faulthandler 2>&1 | tail -2
mkdir -p $OUT && cp /tmp/car.log $OUT/

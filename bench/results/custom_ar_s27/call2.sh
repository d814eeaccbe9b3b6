#!/bin/bash
# Session 27, call 2 (two GPUs): the custom all-reduce (a program per multiprocessor at
# most) through its tests and the tiny models' split runs, then qwen3-8b decode at tp1 /
# tp2 (the custom all-reduce, the default) / tp2-nccl side by side.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python -m pytest -q -x tests/test_kernels_all_reduce_norm.py 2>&1 | tail -1
timeout 200 python -m pytest -q tests/test_custom_all_reduce.py -p no:faulthandler > /tmp/car.log 2>&1
grep -v "^  File" /tmp/car.log | grep "passed\|failed\|FAILED\|Error\|rank 0 stopped" | cut -c1-300 | tail -8
timeout 60 python -m pytest -q tests/test_symm_mem.py 2>&1 | tail -1
timeout 200 python -m pytest -q tests/test_multi_gpu.py -k "tiny-qwen3-tp2 or tiny-nemotron or second_engine" -p no:faulthandler 2>&1 | grep "passed\|failed\|FAILED" | tail -6
timeout 200 python bench/bench_tp.py --configs tp1 tp2 tp2-nccl --parts decode --repeats 1 > /tmp/tp.log 2>&1
grep -A12 "^decode engine" /tmp/tp.log; grep "decode step at batch 1" /tmp/tp.log
mkdir -p $OUT && cp bench/results/bench_tp.json /tmp/car.log /tmp/tp.log $OUT/

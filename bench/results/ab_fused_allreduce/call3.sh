#!/usr/bin/env bash
# Two GPUs: the split tiny models in every graph mode, with and without symmetric memory
# (the fused kernel in every decode and prefill step that fits it); then nemotron-h-8b
# decode at tp1, tp2 and tp2-symm-mem.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 400 python -m pytest -q -s tests/test_multi_gpu.py -k "tiny or symm_mem" > $OUT/multi.log 2>&1
grep -E "passed|failed|Error|error  |tolerance" $OUT/multi.log | tail -12
timeout 150 python bench/bench_hybrid.py --configs tp1 tp2 tp2-symm-mem --parts decode > $OUT/hybrid.log 2>&1
grep -E "^ *tp[12]|/ tp1|Error" $OUT/hybrid.log | tail -14
cp bench/results/bench_hybrid.json $OUT/

#!/usr/bin/env bash
# Two GPUs: qwen3-8b at tp1 and tp2-symm-mem alone in one bench process (the flag's engine
# the process's first: its buffer maps), decode and offline, 3 timed offline runs each.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 560 python bench/bench_tp.py --configs tp1 tp2-symm-mem --parts decode offline --repeats 3 > $OUT/tp.log 2>&1
tr '\r' '\n' < $OUT/tp.log | grep -v "^ *$" | grep -v capturing | tail -22
cp bench/results/bench_tp.json $OUT/

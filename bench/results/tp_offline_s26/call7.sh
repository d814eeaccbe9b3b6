#!/usr/bin/env bash
# Two GPUs: the symmetric-memory GPU test on main, then qwen3-8b offline at tp1 and
# tp2-symm-mem, the flag's engine the bench process's only one (its buffer maps).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 150 python -m pytest -q tests/test_symm_mem.py 2>&1 | tail -2 | tee $OUT/symm_test.log
timeout 400 python bench/bench_tp.py --configs tp1 tp2-symm-mem --parts offline --repeats 3 > $OUT/tp.log 2>&1
tr '\r' '\n' < $OUT/tp.log | grep -v "^ *$" | grep -v capturing | tail -12
cp bench/results/bench_tp.json $OUT/

#!/usr/bin/env bash
# Two GPUs: qwen3-8b decode and offline at tp1, tp2, tp2-symm-mem; qwen3-30b-a3b decode at
# tp2 and tp2-symm-mem.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 330 python bench/bench_tp.py --configs tp1 tp2 tp2-symm-mem --parts decode offline --repeats 1 > $OUT/tp.log 2>&1
grep -E "^ *tp[12]|/ tp1|Error" $OUT/tp.log | tail -14
cp bench/results/bench_tp.json $OUT/
timeout 200 python bench/bench_moe.py --configs tp2 tp2-symm-mem --parts decode > $OUT/moe.log 2>&1
grep -E "^ *tp2|moe_floor_ms /|Error" $OUT/moe.log | tail -10
cp bench/results/bench_moe.json $OUT/

#!/usr/bin/env bash
# Session 24, two H100s: nemotron-h-8b and qwen3-30b-a3b decode at tp2 with and without
# --enable-torch-symm-mem (tp1 beside the hybrid on GPU 0).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 300 python bench/bench_hybrid.py --configs tp1 tp2 tp2-symm-mem --parts decode > $OUT/hybrid.log 2>&1
grep -E "^ *tp[12]|/ tp1|Error" $OUT/hybrid.log | tail -14
timeout 200 python bench/bench_moe.py --configs tp2 tp2-symm-mem --parts decode > $OUT/moe.log 2>&1
grep -E "^ *tp2|moe_floor_ms /|Error" $OUT/moe.log | tail -10
cp bench/results/bench_hybrid.json bench/results/bench_moe.json $OUT/

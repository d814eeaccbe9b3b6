#!/usr/bin/env bash
# Session 24, two H100s: qwen3-30b-a3b ep2-alltoall prefill rows on main with the counted
# exchange's single host sync a layer (alltoall-fewer-syncs merged).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 480 python bench/bench_moe.py --configs ep2-alltoall --parts prefill > $OUT/alltoall_prefill.log 2>&1
grep -E "^ *ep2-alltoall|Error" $OUT/alltoall_prefill.log | tail -16
cp bench/results/bench_moe.json $OUT/

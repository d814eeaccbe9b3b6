#!/usr/bin/env bash
# Session 23 call 1 (nvidia-h100-x4). Lane A (GPUs 0,1): alltoall-profile branch check + the
# 2048-token crossover. Lane B (GPU 2): MoE row kernels: tests, A/B and tune, decode profile.
# Lane C (GPU 3): bench_moe tp1 decode, main then this branch.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD; L=/tmp/l; mkdir -p $L
(export CUDA_VISIBLE_DEVICES=0,1
 cd .carry/wt_prof && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest tests/test_multi_gpu.py \
   -k "tiny and qwen3_moe" -q -p no:cacheprovider --tb=short > $L/prof_multi.log 2>&1
 PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/bench_moe.py --configs ep2-alltoall --parts offline \
   --offline-requests 64 > $L/prof_offline.log 2>&1
 cd $ROOT && PYTHONPATH=/tmp/site:$ROOT timeout 200 python3 .carry/crossover.py > $L/crossover.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=2 PYTHONPATH=/tmp/site:$ROOT
 timeout 150 python3 -m pytest tests/test_kernels_fused_moe.py -q -p no:cacheprovider --tb=short > $L/moe_tests.log 2>&1
 timeout 300 python3 .carry/moe_kernel_ab.py > $L/moe_kernel_ab.log 2>&1
 timeout 100 python3 .carry/profile_decode.py qwen3-30b-a3b > $L/profile_moe.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=3
 cd .carry/wt_main && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 bench/bench_moe.py --configs tp1 --parts decode > $L/decode_main.log 2>&1
 cd $ROOT && PYTHONPATH=/tmp/site:$ROOT timeout 200 python3 bench/bench_moe.py --configs tp1 --parts decode > $L/decode_row.log 2>&1) &
wait
for f in prof_multi prof_offline crossover moe_tests moe_kernel_ab profile_moe decode_main decode_row; do
  echo "== $f"; grep -vE "capturing|Warning|warn" $L/$f.log | tail -12 | cut -c1-160; done
for f in $L/*.log; do echo "=== $f"; cat $f; done > $OUT/all.log 2>&1

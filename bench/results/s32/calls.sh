#!/bin/bash
# Session 32's device calls, on main with the custom all-reduce on by default (two GPUs),
# one part per call: bash bench/results/s32/calls.sh a|b|c|d
#   a  several-GPU tests: the dying cases (a process each) and the tiny llama splits
#   b  several-GPU tests: tiny qwen3, qwen3_moe and nemotron_h splits
#   c  the one-GPU files in two lanes
#   d  benchmarks: qwen3-8b decode and offline at tp1, tp2 (custom) and tp2-nccl (issue 15);
#      nemotron-h-8b and qwen3-30b-a3b decode at tp1 and tp2 (issues 17 and 16)
source bench/results/hang_s29/common.sh
case "$1" in
  a) GPU_CHECK_FILES=multi GPU_CHECK_K="dying or tiny-llama" bash scripts/gpu_check.sh tests ;;
  b) GPU_CHECK_FILES=multi GPU_CHECK_K="tiny-qwen3-tp2 or qwen3_moe or nemotron_h" \
       bash scripts/gpu_check.sh tests ;;
  c) GPU_CHECK_FILES=single GPU_CHECK_LANES=2 bash scripts/gpu_check.sh tests ;;
  d) run tp 330 python bench/bench_tp.py --configs tp1 tp2 tp2-nccl --parts decode offline --repeats 1
     grep -A30 "decode engine step" $OUT/tp.log
     run hybrid 120 python bench/bench_hybrid.py --configs tp1 tp2 --parts decode
     grep -E "/ tp1" $OUT/hybrid.log
     run moe 120 python bench/bench_moe.py --configs tp1 tp2 --parts decode
     grep -E "/ tp1|moe_floor" $OUT/moe.log
     cp bench/results/bench_tp.json bench/results/bench_hybrid.json bench/results/bench_moe.json $OUT/ ;;
  *) echo "usage: $0 a|b|c|d"; exit 2 ;;
esac

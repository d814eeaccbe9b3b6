#!/bin/bash
# For session 32 (two GPUs; NEXT.md items 1 and 2, on main before custom_default.diff), one
# part per device call: bash bench/results/s31/next_calls.sh a|b|c|d
#   a  several-GPU tests: the dying cases (a process each) and tiny llama    (about 350 s)
#   b  several-GPU tests: tiny qwen3, qwen3_moe and nemotron_h splits        (about 450 s)
#   c  the one-GPU files in two lanes                                         (about 330 s)
#   d  the custom all-reduce's missing rows: qwen3-8b offline (issue 15), nemotron-h-8b
#      and qwen3-30b-a3b decode (issues 17 and 16), each beside tp1 in one run
source bench/results/hang_s29/common.sh
case "$1" in
  a) GPU_CHECK_FILES=multi GPU_CHECK_K="dying or tiny-llama" bash scripts/gpu_check.sh tests ;;
  b) GPU_CHECK_FILES=multi GPU_CHECK_K="tiny-qwen3-tp2 or qwen3_moe or nemotron_h" \
       bash scripts/gpu_check.sh tests ;;
  c) GPU_CHECK_FILES=single GPU_CHECK_LANES=2 bash scripts/gpu_check.sh tests ;;
  d) run tp 300 python bench/bench_tp.py --configs tp1 tp2-custom --parts offline --repeats 1
     grep -E "output tok/s|tp2-custom / tp1" $OUT/tp.log
     run hybrid 150 python bench/bench_hybrid.py --configs tp1 tp2-custom --parts decode
     grep -E "/ tp1" $OUT/hybrid.log
     run moe 150 python bench/bench_moe.py --configs tp1 tp2-custom --parts decode
     grep -E "/ tp1|moe_floor" $OUT/moe.log
     cp bench/results/bench_tp.json bench/results/bench_hybrid.json bench/results/bench_moe.json $OUT/ ;;
  *) echo "usage: $0 a|b|c|d"; exit 2 ;;
esac

#!/bin/bash
# Session 40's device calls (bash bench/results/s40/calls.sh X), logs under $OUT:
#   a  one H100: the fused decode stack's GPU tests, then bench_decode (qwen3-0.6b, overlapped
#      full graphs) with the stack off / on, alternating
#   b  same machine: the kernel alone on qwen3-0.6b's shapes, variants of its tiling
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
decode() {  # model switch round
  BCG_DECODE_STACK=$2 run ${1}_s$2_$3 200 python bench/bench_decode.py --models $1 \
    --modes "full graph, overlapped" --label s$2
  grep -hE "^\| ?$1|^$1 " $OUT/${1}_s$2_$3.log | sed "s/^/stack=$2 /"
}
case "$1" in
  a) run stack_tests 300 python -m pytest -q -x -p no:cacheprovider tests/test_decode_stack_gpu.py
     tail -30 $OUT/stack_tests.log
     for round in 1 2; do for s in 0 1; do decode qwen3-0.6b $s $round; done; done ;;
  b) run micro 300 python bench/results/s40/stack_micro.py $VARIANTS; cat $OUT/micro.log
     run micro_nobarrier 120 python bench/results/s40/stack_micro.py "no barrier"
     cat $OUT/micro_nobarrier.log ;;
esac
tar czf $OUT_ALL/logs.tgz -C /tmp/out .

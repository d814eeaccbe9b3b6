#!/bin/bash
# Session 39's device calls (bash bench/results/s39/calls.sh X), logs under $OUT:
#   a  one H100: s38's pdl_tests.diff (next_calls.sh), the skinny kernel's and PDL tests with
#      BCG_SKINNY_PRELOAD=2 (weight tiles loaded before the PDL wait), then bench_decode
#      (qwen3-0.6b, overlapped full graphs) with 0, 2 and 1 tiles preloaded
#   b  same machine: qwen3-0.6b again (1, 2, 0) and qwen3-8b (0, 2)
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
decode() {  # model tiles
  BCG_SKINNY_PRELOAD=$2 run ${1}_p$2_$RANDOM 150 python bench/bench_decode.py --models $1 \
    --modes "full graph, overlapped" --label p$2
  grep -hE "^$1 " $(ls -t $OUT/${1}_p$2_*.log | head -1) | sed "s/^/p$2 /"
}
case "$1" in
  a) mkdir -p /tmp/next && OUT=/tmp/next bash bench/results/s38/next_calls.sh  # log: $OUT/pdl_tests.log
     BCG_SKINNY_PRELOAD=2 run preload_tests 200 python -m pytest -q -p no:cacheprovider \
       tests/test_kernels_skinny_linear.py tests/test_kernels_pdl.py
     for t in 0 2 1; do decode qwen3-0.6b $t; done ;;
  b) for t in 1 2 0; do decode qwen3-0.6b $t; done
     for t in 0 2; do decode qwen3-8b $t; done ;;
  *) echo "usage: $0 a|b"; exit 2 ;;
esac
tar czf $OUT_ALL/logs.tgz -C $OUT .

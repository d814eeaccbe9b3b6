#!/bin/bash
# Session 43's device calls (bash bench/results/s43/calls.sh X [args]), logs under $OUT:
#   a  two H200s: the skinny kernel's L2 prefetch before its PDL wait. Skinny, PDL and
#      all-reduce-norm kernel tests, then bench_tp decode (tp1, tp2) at
#      BCG_SKINNY_PREFETCH_K = 0, 1024, 2048
#   b  same machine: bench_tp decode again at each BCG_SKINNY_PREFETCH_K given ("0 1024 ...")
source bench/results/hang_s29/common.sh
tp() {  # prefetch_k
  local name=tp_k$1_$RANDOM start=$SECONDS
  BCG_SKINNY_PREFETCH_K=$1 run $name 200 python bench/bench_tp.py --configs tp1 tp2 --parts decode
  grep -E "^ +tp[0-9] +[0-9]+ +[0-9.]+ |batch 1: [0-9]" $OUT/$name.log | sed "s/^/k$1 /"
  echo "k$1 took $((SECONDS - start)) s"
}
case "$1" in
  a) run kernels 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_skinny_linear.py \
       tests/test_kernels_pdl.py tests/test_kernels_all_reduce_norm.py
     for k in 0 1024 2048; do tp $k; done ;;
  b) for k in $2; do tp $k; done ;;
  *) echo "usage: $0 a | b \"K...\""; exit 2 ;;
esac

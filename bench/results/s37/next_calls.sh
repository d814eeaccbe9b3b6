#!/bin/bash
# For session 38 (two H200s, `nvidia-h200-x2`): bash bench/results/s37/next_calls.sh a|b
#   a  pdl_more.diff applied in /tmp/more (the custom all-reduce, the send path and the MoE
#      kernels launched early too): the kernel tests it touches, the two-GPU custom all-reduce
#      and symmetric-memory tests, the dense, hybrid and MoE splits in every graph mode
#      (about 450 s)
#   b  decode at tp1 and tp2 of qwen3-8b and qwen3-30b-a3b, main then the diff, twice
#      (ROUNDS="1" or "2" runs one round, to stay under a call's ten minutes)
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
MAIN=$PWD
rm -rf /tmp/more && cp -r "$MAIN" /tmp/more && (cd /tmp/more &&
  git apply "$MAIN/bench/results/s37/pdl_more.diff") || exit 1
case "$1" in
  a) cd /tmp/more && export PYTHONPATH=/tmp/site:/tmp/more
     run kernels 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py \
       tests/test_kernels_fused_moe.py tests/test_kernels_moe_routing.py \
       tests/test_kernels_skinny_linear.py tests/test_kernels_pdl.py
     run car 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py \
       tests/test_symm_mem.py
     run multi 420 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "nemotron-h-8b-tp2 or qwen3-8b-tp2 or qwen3_moe or qwen3-30b-a3b" tests/test_multi_gpu.py ;;
  b) for round in ${ROUNDS:-1 2}; do
       for tree in "$MAIN" /tmp/more; do
         name=$(basename $tree)_$round
         (cd $tree && PYTHONPATH=/tmp/site:$tree run tp_$name 200 python bench/bench_tp.py \
           --configs tp1 tp2 --parts decode)
         (cd $tree && PYTHONPATH=/tmp/site:$tree run moe_$name 200 python bench/bench_moe.py \
           --configs tp1 tp2 --parts decode)
         grep -hE "^ +tp[0-9] +[0-9]+ +[0-9.]+ |batch 1" $OUT/tp_$name.log $OUT/moe_$name.log
       done
     done ;;
  *) echo "usage: $0 a|b"; exit 2 ;;
esac
tar czf $OUT_ALL/logs.tgz -C $OUT .

#!/bin/bash
# For session 36 (two H200s, `nvidia-h200-x2`): bash bench/results/s35/next_calls.sh a|b|c
#   a  ar_epilogue.diff (a row-parallel projection sends its parts from the skinny kernel's
#      epilogue) applied in /tmp/epi: its kernel and two-GPU tests, then dummy nemotron-h-8b
#      split in every graph mode (the tiny models' projections are too narrow for the
#      skinny kernel, so only the 8B-shaped dummies take the new path in their decode steps)
#      and a worker dying mid-step
#   c  the same for dummy qwen3-8b
#   b  bench_hybrid and bench_tp decode, main and /tmp/epi interleaved, tp1 in each run
#      (about 330 s); logs and JSONs in $OUT/logs.tgz
source bench/results/hang_s29/common.sh
MAIN=$PWD
rm -rf /tmp/epi && cp -r "$MAIN" /tmp/epi && (cd /tmp/epi &&
  git apply "$MAIN/bench/results/s35/ar_epilogue.diff") || exit 1
decode() {  # bench name tree: its decode rows at tp1 and tp2
  local bench=$1 name=$2 tree=$3
  (cd $tree && PYTHONPATH=/tmp/site:$tree run $name 240 python bench/$bench.py \
     --configs tp1 tp2 --parts decode
   cp bench/results/$bench.json $OUT/$name.json)
  grep -E "^ +tp[0-9].* [0-9]+ +[0-9.]+ |decode step at batch 1: [0-9]" $OUT/$name.log
}
case "$1" in
  a) cd /tmp/epi && export PYTHONPATH=/tmp/site:/tmp/epi
     run kernels 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py \
       tests/test_kernels_skinny_linear.py
     run car 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py \
       tests/test_symm_mem.py
     run multi 380 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "nemotron-h-8b-tp2 or dying" tests/test_multi_gpu.py ;;
  c) cd /tmp/epi && export PYTHONPATH=/tmp/site:/tmp/epi
     run multi 500 python -m pytest -q -m gpu -p no:cacheprovider -k "qwen3-8b-tp2" \
       tests/test_multi_gpu.py ;;
  b) export OUT_ALL=$OUT && export OUT=/tmp/out && mkdir -p $OUT
     decode bench_hybrid h1_main $MAIN
     decode bench_hybrid h2_epi /tmp/epi
     decode bench_tp t1_main $MAIN
     decode bench_tp t2_epi /tmp/epi
     decode bench_hybrid h3_epi /tmp/epi
     decode bench_hybrid h4_main $MAIN
     tar czf $OUT_ALL/logs.tgz -C $OUT . ;;
  *) echo "usage: $0 a|b|c"; exit 2 ;;
esac

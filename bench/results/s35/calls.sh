#!/bin/bash
# Session 35's device calls (two H200s): bash bench/results/s35/calls.sh a|b|...
#   a  s34's candidates (pipe_step_channel.diff + uniform_release_reads.diff) in /tmp/cand:
#      their several-GPU tests, then bench_hybrid decode: main tp1 tp2, cand tp2, main tp2
source bench/results/hang_s29/common.sh
MAIN=$PWD
cand_tree() {  # /tmp/cand: this tree with the named diffs applied
  rm -rf /tmp/cand && cp -r "$MAIN" /tmp/cand && cd /tmp/cand || exit 1
  for diff in "$@"; do git apply "$diff" || exit 1; done
  cd "$MAIN"
}
hybrid() {  # name tree configs...: bench_hybrid decode in tree, its JSON to $OUT/name.json
  local name=$1 tree=$2; shift 2
  (cd $tree && PYTHONPATH=/tmp/site:$tree run $name 200 python bench/bench_hybrid.py \
     --configs "$@" --parts decode
   cp bench/results/bench_hybrid.json $OUT/$name.json)
  sed -n '/decode engine step/,/tp2 \/ tp1/p' $OUT/$name.log | grep -v "not measured\|floor:\|eager"
}
case "$1" in
  a) cand_tree "$MAIN/bench/results/s34/pipe_step_channel.diff" \
       "$MAIN/bench/results/s34/uniform_release_reads.diff"
     hybrid 1_main $MAIN tp1 tp2
     hybrid 2_cand /tmp/cand tp2
     hybrid 3_main $MAIN tp2
     cd /tmp/cand && export PYTHONPATH=/tmp/site:/tmp/cand
     GPU_CHECK_FILES=single bash scripts/gpu_check.sh "tests kernels_all_reduce_norm" 2>&1 | tail -1
     run car 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py tests/test_symm_mem.py
     GPU_CHECK_FILES=multi GPU_CHECK_K="tiny-llama or dying or tiny-nemotron_h" bash scripts/gpu_check.sh "tests multi_gpu" 2>&1 | tail -3
     ;;
  *) echo "usage: $0 a"; exit 2 ;;
esac

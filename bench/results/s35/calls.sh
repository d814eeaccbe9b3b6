#!/bin/bash
# Session 35's device calls (two H200s): bash bench/results/s35/calls.sh a|b|...
#   a  s34's candidates (pipe_step_channel.diff + uniform_release_reads.diff) in /tmp/cand:
#      their several-GPU tests, then bench_hybrid decode: main tp1 tp2, cand tp2, main tp2
#   b  the Lamport all-reduce (this tree, branch lamport) against main (/tmp/main: this tree
#      less lamport.diff):
#      its kernel and two-GPU tests, then bench_hybrid and bench_tp decode interleaved;
#      every log in $OUT/logs.tgz
#   c  the logits head through the skinny kernel (this tree, branch head, on the Lamport
#      merge) against main (/tmp/main: this tree less head.diff): the head's shapes in
#      bench_skinny_linear, the one-GPU test files the head touches (two lanes), bench_hybrid
#      and bench_tp decode A/B, then the tiny several-GPU models; logs in $OUT/logs.tgz
source bench/results/hang_s29/common.sh
MAIN=$PWD
cand_tree() {  # /tmp/cand: this tree with the named diffs applied
  rm -rf /tmp/cand && cp -r "$MAIN" /tmp/cand && cd /tmp/cand || exit 1
  for diff in "$@"; do git apply "$diff" || exit 1; done
  cd "$MAIN"
}
hybrid() {  # name tree configs...: bench_hybrid decode in tree, its JSON to $OUT/name.json
  bench_decode bench_hybrid "$@"
}
bench_decode() {  # bench name tree configs...: its decode rows, its JSON to $OUT/name.json
  local bench=$1 name=$2 tree=$3; shift 3
  (cd $tree && PYTHONPATH=/tmp/site:$tree run $name 240 python bench/$bench.py \
     --configs "$@" --parts decode
   cp bench/results/$bench.json $OUT/$name.json)
  grep -E "^ +tp[0-9].* [0-9]+ +[0-9.]+ |decode step at batch 1: [0-9]" $OUT/$name.log
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
  b) rm -rf /tmp/main && cp -r "$MAIN" /tmp/main && (cd /tmp/main &&
       git apply -R "$MAIN/bench/results/s35/lamport.diff") || exit 1
     export OUT_ALL=$OUT && export OUT=/tmp/out && mkdir -p $OUT
     GPU_CHECK_FILES=single bash scripts/gpu_check.sh "tests kernels_all_reduce_norm" 2>&1 | tail -1
     run car 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py tests/test_symm_mem.py
     grep -E "passed|failed" $OUT/car.log | tail -2
     hybrid h1_main /tmp/main tp1 tp2
     hybrid h2_lamport $PWD tp2
     hybrid h3_main /tmp/main tp2
     hybrid h4_lamport $PWD tp1 tp2
     bench_decode bench_tp t1_main /tmp/main tp1 tp2
     bench_decode bench_tp t2_lamport $PWD tp2
     bench_decode bench_tp t3_main /tmp/main tp2
     bench_decode bench_tp t4_lamport $PWD tp1 tp2
     GPU_CHECK_FILES=multi GPU_CHECK_K="dying" bash scripts/gpu_check.sh "tests multi_gpu" 2>&1 | tail -1
     tar czf $OUT_ALL/logs.tgz -C $OUT . ;;
  c) rm -rf /tmp/main && cp -r "$MAIN" /tmp/main && (cd /tmp/main &&
       git apply -R "$MAIN/bench/results/s35/head.diff") || exit 1
     export OUT_ALL=$OUT && export OUT=/tmp/out && mkdir -p $OUT
     run skinny 90 python bench/bench_skinny_linear.py --projs lm_head --rows 1 8 16
     grep -E "lm_head" $OUT/skinny.log
     GPU_CHECK_LANES=2 GPU_CHECK_FILES=single timeout 200 bash scripts/gpu_check.sh \
       "tests graph_runners_gpu models_hf engine_generate" 2>&1 | tail -4
     hybrid h1_head $PWD tp1 tp2
     hybrid h2_main /tmp/main tp1 tp2
     bench_decode bench_tp t1_head $PWD tp1 tp2
     bench_decode bench_tp t2_main /tmp/main tp1 tp2
     tar czf $OUT_ALL/logs.tgz -C $OUT .
     GPU_CHECK_FILES=multi GPU_CHECK_K="tiny-llama or tiny-nemotron_h" timeout 150 \
       bash scripts/gpu_check.sh "tests multi_gpu" 2>&1 | tail -1
     tar czf $OUT_ALL/logs.tgz -C $OUT . ;;
  e) # the projection's epilogue sending its parts (this tree, ar_epilogue.diff) against main:
     # its two-GPU tests, then bench_hybrid tp2 decode on each tree (the last of the budget)
     rm -rf /tmp/main && cp -r "$MAIN" /tmp/main && (cd /tmp/main &&
       git apply -R "$MAIN/bench/results/s35/ar_epilogue.diff") || exit 1
     run car 70 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py
     run kernels 30 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py
     hybrid h1_epilogue $PWD tp2
     hybrid h2_main /tmp/main tp2 ;;
  *) echo "usage: $0 a|b|c|e"; exit 2 ;;
esac

#!/bin/bash
# Session 39's device calls (bash bench/results/s39/calls.sh X), logs under $OUT:
#   a  one H100: s38's pdl_tests.diff (next_calls.sh), the skinny kernel's and PDL tests with
#      BCG_SKINNY_PRELOAD=2 (weight tiles loaded before the PDL wait), then bench_decode
#      (qwen3-0.6b, overlapped full graphs) with 0, 2 and 1 tiles preloaded
#   (b was qwen3-0.6b and -8b again with the preload: not run, call a had settled it)
#   c  two H200s, branch ar-early-loads (the all-reduce's residual and norm weight loaded
#      before it waits for the peers): kernel, custom all-reduce and symmetric-memory tests,
#      then bench_tp decode (tp1, tp2) main / branch / main / branch
#   d  same machine: bench_moe and bench_hybrid decode (tp1, tp2) on the branch (the JSON
#      rows)
#   e  same machine: dummy nemotron-h-8b, qwen3-30b-a3b and qwen3-8b split in every graph mode
#   f  two H200s, branch ar-early-loads with send_hoist.diff (a sending projection reads its
#      call counts and slot addresses before its weight loop): kernel, custom all-reduce and
#      symmetric-memory tests, then bench_tp and bench_hybrid decode (tp1, tp2), without the
#      hoist / with it, twice
#   g  same machine: dummy qwen3-8b and nemotron-h-8b split in every graph mode, then the
#      one-GPU test files but the kernels' (calls c and f ran the changed ones) in two lanes
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
  c) BRANCH=$PWD && rm -rf /tmp/main0 && cp -r "$BRANCH" /tmp/main0 &&
       (cd /tmp/main0 && git apply -R "$BRANCH/bench/results/s39/ar_early_loads.diff") || exit 1
     run kernels 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py \
       tests/test_kernels_small_ops.py tests/test_kernels_pdl.py
     run car 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py \
       tests/test_symm_mem.py
     for round in 1 2; do
       for tree in /tmp/main0 "$BRANCH"; do
         name=tp_$(basename $tree)_$round
         (cd $tree && PYTHONPATH=/tmp/site:$tree run $name 150 python bench/bench_tp.py \
           --configs tp1 tp2 --parts decode)
         grep -E "^ +tp[0-9] +[0-9]+ +[0-9.]+ |batch 1" $OUT/$name.log | sed "s/^/$name /"
       done
     done ;;
  d) for bench in bench_moe bench_hybrid; do
       run $bench 200 python bench/$bench.py --configs tp1 tp2 --parts decode
       cp bench/results/$bench.json $OUT/
       grep -E "^ +tp[0-9] +[0-9]+ +[0-9.]+ |batch 1" $OUT/$bench.log
     done ;;
  e) run multi 560 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "nemotron-h-8b-tp2 or qwen3-30b-a3b or qwen3-8b-tp2" tests/test_multi_gpu.py ;;
  f) BRANCH=$PWD && rm -rf /tmp/nohoist && cp -r "$BRANCH" /tmp/nohoist &&
       (cd /tmp/nohoist && git apply -R "$BRANCH/bench/results/s39/send_hoist.diff") || exit 1
     run kernels 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py \
       tests/test_kernels_skinny_linear.py tests/test_kernels_pdl.py
     run car 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py \
       tests/test_symm_mem.py
     for round in 1 2; do
       for tree in /tmp/nohoist "$BRANCH"; do
         for bench in bench_tp bench_hybrid; do
           [ $round = 2 ] && [ $bench = bench_hybrid ] && continue
           name=${bench}_$(basename $tree)_$round
           (cd $tree && PYTHONPATH=/tmp/site:$tree run $name 150 python bench/$bench.py \
             --configs tp1 tp2 --parts decode)
           grep -E "^ +tp[0-9] +[0-9]+ +[0-9.]+ |batch 1" $OUT/$name.log | sed "s/^/$name /"
         done
       done
     done ;;
  g) run multi 300 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "nemotron-h-8b-tp2 or qwen3-8b-tp2" tests/test_multi_gpu.py
     GPU_CHECK_LANES=2 GPU_CHECK_FILES=single OUT=/tmp/out/suite timeout 240 bash \
       scripts/gpu_check.sh "tests graph_runners_gpu models_hf engine_generate overlap" \
       > /tmp/out/suite.log 2>&1; echo "suite rc $?"; sed -n '/=== summary/,$p' /tmp/out/suite.log ;;
  *) echo "usage: $0 a|c|d|e|f|g"; exit 2 ;;
esac
tar czf $OUT_ALL/logs.tgz -C $OUT .

#!/bin/bash
# Session 43's device calls (bash bench/results/s43/calls.sh X [args]), logs under $OUT:
#   a  two H200s: the skinny kernel's L2 prefetch before its PDL wait. Skinny, PDL and
#      all-reduce-norm kernel tests, then bench_tp decode (tp1, tp2) at
#      BCG_SKINNY_PREFETCH_K = 0, 1024, 2048
#   b  same machine: bench_tp decode again at each BCG_SKINNY_PREFETCH_K given ("0 1024 ...")
#      (a and b need skinny_prefetch.diff applied; b was not run: a had settled it)
#   c  two H200s: profile_step.py tp1 tp2 (rank 0's kernels and one step's timeline)
#   d  two H200s: profile_step.py's per-layer medians at tp1 and tp2 under each variant given
#      as an environment assignment ("X=1 Y=2"; "-" for none): BCG_PDL=0, and knobs that
#      existed only in that call's tree: BCG_ATTN_LATE=1 (decode attention lets the o
#      projection start only as it exits; main's behaviour since 040b809) and the skinny
#      kernel's BCG_SKINNY_STAGES=N, BCG_SKINNY_K=N, BCG_SKINNY_NARROW=N (skinny_knobs.diff).
#      Calls d, e, h, i ran it (logs callD, callE, callH, callI)
#   f  two H200s, decode attention letting the next kernel start only as it exits (the tree)
#      against main (bench/results/s43/main_tree, a git archive of 66cae4b's bcg/ put first
#      on PYTHONPATH): decode attention and PDL tests, then bench_tp decode (tp1, tp2) main /
#      tree / main / tree
#   g  same machine: the one-GPU test files of graph runners, HF models, graphs, engine
#      generate and overlap, in two lanes
#   j  one H100: after the top-k sum's jit helper moved (sum_choice_rows), the small-op, MoE
#      kernel, PDL, routing and MoE model tests and the graph runners' MoE and norm cases
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
  c) run profile 400 python bench/results/s43/profile_step.py tp1 tp2
     grep -v "^\[" $OUT/profile.log | grep -vE "capturing|Warning|_warn_once" ;;
  d) shift; for variant in "$@"; do
       name=prof_$(echo "$variant" | tr -c 'A-Za-z0-9\n' _)
       env $( [ "$variant" = - ] || echo $variant ) timeout 200 python \
         bench/results/s43/profile_step.py tp1 tp2 > $OUT/$name.log 2>&1; echo "$variant rc $?"
       grep -E "^== |^  [a-z/_]+ +[0-9.]+$" $OUT/$name.log | sed "s/^/$variant /"
     done ;;
  f) run kernels 300 python -m pytest -q -p no:cacheprovider tests/test_kernels_decode_attention.py \
       tests/test_kernels_pdl.py tests/test_attention_op.py
     for round in 1 2; do
       for tree in main tree; do
         name=tp_${tree}_$round
         if [ $tree = main ]; then path=$PWD/bench/results/s43/main_tree:$PYTHONPATH; else path=$PYTHONPATH; fi
         PYTHONPATH=$path run $name 200 python bench/bench_tp.py --configs tp1 tp2 --parts decode
         grep -E "^ +tp[0-9] +[0-9]+ +[0-9.]+ |batch 1: [0-9]" $OUT/$name.log | sed "s/^/$name /"
       done
     done ;;
  g) GPU_CHECK_LANES=2 GPU_CHECK_FILES=single OUT=/tmp/out/suite timeout 420 bash \
       scripts/gpu_check.sh "tests graph_runners_gpu models_hf engine_generate overlap graph_gpu" \
       > $OUT/suite.log 2>&1; echo "suite rc $?"; sed -n '/=== summary/,$p' $OUT/suite.log ;;
  j) run moe_tests 330 python -m pytest -q -p no:cacheprovider tests/test_kernels_small_ops.py \
       tests/test_kernels_fused_moe.py tests/test_kernels_pdl.py tests/test_kernels_moe_routing.py \
       tests/test_models_qwen3_moe.py tests/test_graph_runners_gpu.py \
       -k "moe or sum_add or rms_norm or pdl or test_kernels_fused or routing"
     tail -3 $OUT/moe_tests.log ;;
  *) echo "usage: $0 a | b \"K...\" | c"; exit 2 ;;
esac

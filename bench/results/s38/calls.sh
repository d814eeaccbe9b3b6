#!/bin/bash
# Session 38's device calls: bash bench/results/s38/calls.sh c|d|e  (a and b were s37's
# next_calls.sh a and b on two H200s; their logs are in callB/)
#   c  one H100, main with pdl_more merged: the one-GPU test files but the kernels
#   d  same machine: the kernel files pdl_more touched only through the launch option, then
#      offline qwen3-8b (decode + breakable, overlapped, 2 repeats) with BCG_PDL=0, then on
#   e  two H200s: bench_tp and bench_moe decode at tp1 and tp2 (the JSON rows)
#   f  one H100, mamba_pdl.diff applied in /tmp/mamba (the Mamba2 decode kernels launched
#      early): the kernel tests it touches, NemotronH on the GPU, then bench_hybrid's tp1
#      decode rows, main then the diff, twice (the diff, merged since, is no longer here)
#   g  one H100: offline qwen3-8b (decode + breakable, overlapped) with decode attention's
#      large-batch launch changed: twice the splits, 8 warps, 3 stages, beside main
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
case "$1" in
  c) GPU_CHECK_LANES=1 GPU_CHECK_FILES=single OUT=/tmp/out/suite timeout 560 bash \
       scripts/gpu_check.sh "tests graph_runners_gpu models_hf engine_generate overlap" \
       > /tmp/out/suite.log 2>&1; echo "suite rc $?"; sed -n '/=== summary/,$p' /tmp/out/suite.log ;;
  d) run kernels 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_decode_attention.py \
       tests/test_kernels_small_ops.py tests/test_kernels_extend_attention.py
     for pdl in 0 1; do
       BCG_PDL=$pdl run offline_pdl$pdl 200 python bench/bench_offline.py --models qwen3-8b \
         --modes "decode + breakable" --overlap on --repeats 2
       cp bench/results/bench_offline_qwen3-8b.json $OUT/offline_pdl$pdl.json
       grep -E "decode \+ breakable" $OUT/offline_pdl$pdl.log | tail -2
     done ;;
  e) for bench in bench_tp bench_moe; do
       run $bench 200 python bench/$bench.py --configs tp1 tp2 --parts decode
       cp bench/results/$bench.json $OUT/
       grep -E "^ +tp[0-9] +[0-9]+ +[0-9.]+ |batch 1" $OUT/$bench.log
     done ;;
  f) MAIN=$PWD && rm -rf /tmp/mamba && cp -r "$MAIN" /tmp/mamba &&
       (cd /tmp/mamba && git apply "$MAIN/bench/results/s38/mamba_pdl.diff") || exit 1
     (cd /tmp/mamba && export PYTHONPATH=/tmp/site:/tmp/mamba &&
       run mamba_kernels 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_pdl.py \
         tests/test_kernels_mamba.py tests/test_kernels_small_ops.py &&
       run mamba_models 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_nemotron_h.py \
         tests/test_graph_runners_gpu.py -k "nemotron or hybrid or mamba")
     for round in 1 2; do
       for tree in "$MAIN" /tmp/mamba; do
         name=hybrid_$(basename $tree)_$round
         (cd $tree && PYTHONPATH=/tmp/site:$tree run $name 150 python bench/bench_hybrid.py \
           --configs tp1 --parts decode)
         grep -E "^ +tp1 +[0-9]+ +[0-9.]+ " $OUT/$name.log | sed "s/^/$name /"
       done
     done
     cp /tmp/mamba/bench/results/bench_hybrid.json $OUT/ ;;
  g) MAIN=$PWD
     declare -A EDITS=(
       [split2]='s/target_programs = PROGRAMS_PER_SM \*/target_programs = 2 * PROGRAMS_PER_SM */'
       [warps8]='s/gpu=DecodeConfig(block_n=128)/gpu=DecodeConfig(block_n=128, num_warps=8)/'
       [stages3]='s/gpu=DecodeConfig(block_n=128)/gpu=DecodeConfig(block_n=128, num_stages=3)/')
     for variant in main split2 warps8 stages3; do
       tree=$MAIN
       if [ $variant != main ]; then
         tree=/tmp/$variant && rm -rf $tree && cp -r "$MAIN" $tree &&
           sed -i "${EDITS[$variant]}" $tree/bcg/kernels/decode_attention.py
         (cd $tree && git diff --stat)
       fi
       (cd $tree && PYTHONPATH=/tmp/site:$tree run offline_$variant 150 python \
         bench/bench_offline.py --models qwen3-8b --modes "decode + breakable" --overlap on \
         --repeats 2)
       grep -E "^qwen3-8b +decode" $OUT/offline_$variant.log | tail -1 | sed "s/^/$variant /"
     done ;;
  *) echo "usage: $0 c|d|e|f|g"; exit 2 ;;
esac
tar czf $OUT_ALL/logs.tgz -C $OUT .

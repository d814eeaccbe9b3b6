#!/bin/bash
# For session 33: the squared-ReLU epilogue (relu2_epilogue.diff, CPU-tested, not merged)
# against main, one part per device call: bash bench/results/s32/next_calls.sh a|b|c
#   a  (two GPUs) A/B in one call: bench_hybrid tp1 tp2 decode and bench_skinny_linear on
#      nemotron-h-8b, main's tree then the patched copy, twice, alternating
#   b  (two GPUs, on the patched tree) the one-GPU files in two lanes (about 370 s)
#   c  (two GPUs, on the patched tree) the NemotronH and tiny Llama splits of
#      test_multi_gpu.py; if b and c pass and a shows a gain, merge the diff
source bench/results/hang_s29/common.sh
patched=/tmp/relu2_tree
rm -rf $patched && cp -r . $patched && (cd $patched && git apply bench/results/s32/relu2_epilogue.diff)
case "$1" in
  a) for round in 1 2; do
       for tree in main patched; do
         dir=$PWD; [ $tree = patched ] && dir=$patched
         (cd $dir && PYTHONPATH=/tmp/site:$dir run hybrid_${tree}_$round 200 \
            python bench/bench_hybrid.py --configs tp1 tp2 --parts decode)
         grep -A10 "decode engine step" $OUT/hybrid_${tree}_$round.log | grep -E "tp1|tp2"
       done
     done
     (cd $patched && PYTHONPATH=/tmp/site:$patched run skinny 120 \
        python bench/bench_skinny_linear.py --models nemotron-h-8b "nemotron-h-8b tp2")
     tail -20 $OUT/skinny.log ;;
  b) cd $patched && GPU_CHECK_FILES=single GPU_CHECK_LANES=2 bash scripts/gpu_check.sh tests ;;
  c) cd $patched && GPU_CHECK_FILES=multi GPU_CHECK_K="nemotron_h or tiny-llama" \
       bash scripts/gpu_check.sh tests ;;
  *) echo "usage: $0 a|b|c"; exit 2 ;;
esac

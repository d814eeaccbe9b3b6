#!/bin/bash
# For session 33: two CPU-tested patches for NemotronH's decode step, not merged, against
# main: relu2_epilogue.diff (squared ReLU inside the up projection) and, on top of it,
# mamba_decode_fused.diff (the conv update inside the selective state update, the conv
# state a ring). One part per device call: bash bench/results/s32/next_calls.sh a|b|c|d
#   a  (two GPUs) A/B in one call, each tree in turn: bench_hybrid tp1 tp2 decode and
#      bench_kernels (kernels per layer) on main, main + relu2, main + both; then
#      bench_skinny_linear's nemotron rows                                  (about 450 s)
#   b  (two GPUs, main + both) the one-GPU files in two lanes               (about 370 s)
#   c  (two GPUs, main + both) the NemotronH and tiny Llama splits of test_multi_gpu.py
#   d  (two GPUs, main) NEXT.md item 2's probe: per-step times of qwen3-8b decode at batch 64,
#      tp1 and tp2, 8 rounds each                                          (about 150 s)
# Merge a patch if b and c pass and a shows its gain; report a's numbers either way.
source bench/results/hang_s29/common.sh
tree() {  # name diffs...: a copy of this checkout with the diffs applied, at /tmp/tree_<name>
    local dir=/tmp/tree_$1; shift
    rm -rf $dir && cp -r . $dir
    for diff in "$@"; do (cd $dir && git apply bench/results/s32/$diff) || exit 1; done
    echo $dir
}
main_dir=$(tree main)
relu2_dir=$(tree relu2 relu2_epilogue.diff)
both_dir=$(tree both relu2_epilogue.diff mamba_decode_fused.diff)
in_tree() {  # dir name limit command...: `run` inside that tree, on its code
    local dir=$1; shift
    (cd $dir && PYTHONPATH=/tmp/site:$dir run "$@")
}
case "$1" in
  a) for name in main relu2 both; do
       dir=/tmp/tree_$name
       in_tree $dir hybrid_$name 200 python bench/bench_hybrid.py --configs tp1 tp2 --parts decode
       grep -A10 "decode engine step" $OUT/hybrid_$name.log | grep -E "^ *tp[12] "
       in_tree $dir kernels_$name 120 python bench/bench_kernels.py --models nemotron-h-8b \
         --label $name
       tail -6 $OUT/kernels_$name.log
       cp $dir/bench/results/bench_hybrid.json $OUT/hybrid_$name.json
       cp $dir/bench/results/bench_kernels_$name.json $OUT/kernels_$name.json
     done
     in_tree $both_dir skinny 120 python bench/bench_skinny_linear.py \
       --models nemotron-h-8b "nemotron-h-8b tp2"
     tail -14 $OUT/skinny.log
     cp $both_dir/bench/results/bench_skinny_linear.json $OUT/skinny.json ;;
  b) cd $both_dir && GPU_CHECK_FILES=single GPU_CHECK_LANES=2 bash scripts/gpu_check.sh tests ;;
  c) cd $both_dir && GPU_CHECK_FILES=multi GPU_CHECK_K="nemotron_h or tiny-llama" \
       bash scripts/gpu_check.sh tests ;;
  d) run probe 300 python bench/results/s32/step_times_probe.py 8
     grep round $OUT/probe.log ;;
  *) echo "usage: $0 a|b|c|d"; exit 2 ;;
esac

#!/bin/bash
# Session 33's device calls, run on branch s33 (main + s32's squared-ReLU patch + the parallel_state mend;
# s33.diff is both against main bf598af; a-c ran with s32's fused Mamba decode as well).
# One part per device call: bash bench/results/s33/next_calls.sh a|b|c|d
#   a  (two GPUs) A/B in one call: bench_hybrid tp1 tp2 decode on main, s33, and s33 with
#      the fused Mamba decode kernel at 8 warps; bench_kernels (kernels per layer) on main
#      and s33; bench_skinny_linear's nemotron rows on s33
#   b  (two GPUs) the one-GPU test files in two lanes, on s33
#   c  (two GPUs) the NemotronH, tiny Llama and dying-worker splits of test_multi_gpu.py
#   e  (four GPUs) after dropping the fused Mamba decode (a showed it slower at batch 64):
#      bench_hybrid tp1 tp2 decode on main and s33, then the one-GPU files it touches
#   f  (four GPUs) the qwen3-32b-tp4 case of test_multi_gpu.py (custom all-reduce at 4 ranks)
#   d  (two GPUs) s32's probe: per-step times of qwen3-8b decode at batch 64, tp1 and tp2
source bench/results/hang_s29/common.sh
tree() {  # name: a copy of this checkout at /tmp/tree_<name>
    rm -rf /tmp/tree_$1 && cp -r . /tmp/tree_$1 && echo /tmp/tree_$1
}
in_tree() {  # dir name limit command...: `run` inside that tree, on its code
    local dir=$1; shift
    (cd $dir && PYTHONPATH=/tmp/site:$dir run "$@")
}
case "$1" in
  a) main_dir=$(tree main); (cd $main_dir && git apply -R bench/results/s33/s33.diff) || exit 1
     warps_dir=$(tree warps8)
     python3 - $warps_dir/bcg/kernels/mamba_decode.py <<'PY' || exit 1
import sys
path = sys.argv[1]
text = open(path).read()
anchor = '"BLOCK_P": block_p, "BLOCK_N": next_power_of_2(state_size)},\n'
assert text.count(anchor) == 1
open(path, "w").write(text.replace(anchor, anchor + "        num_warps=8,\n"))
PY
     for name in main s33 warps8; do
       dir=/tmp/tree_$name; [ $name = s33 ] && dir=$PWD
       in_tree $dir hybrid_$name 200 python bench/bench_hybrid.py --configs tp1 tp2 --parts decode
       grep -A10 "decode engine step" $OUT/hybrid_$name.log | grep -E "^ *tp[12] "
       cp $dir/bench/results/bench_hybrid.json $OUT/hybrid_$name.json
       [ $name = warps8 ] && continue
       in_tree $dir kernels_$name 120 python bench/bench_kernels.py --models nemotron-h-8b \
         --label $name
       tail -6 $OUT/kernels_$name.log
       cp $dir/bench/results/bench_kernels_$name.json $OUT/kernels_$name.json
     done
     run skinny 120 python bench/bench_skinny_linear.py --models nemotron-h-8b "nemotron-h-8b tp2"
     tail -14 $OUT/skinny.log
     cp bench/results/bench_skinny_linear.json $OUT/skinny.json ;;
  b) GPU_CHECK_FILES=single GPU_CHECK_LANES=2 bash scripts/gpu_check.sh tests ;;
  c) GPU_CHECK_FILES=multi GPU_CHECK_K="nemotron_h or tiny-llama or dying" \
       bash scripts/gpu_check.sh tests ;;
  e) main_dir=$(tree main); (cd $main_dir && git apply -R bench/results/s33/s33.diff) || exit 1
     for name in main s33; do
       dir=/tmp/tree_$name; [ $name = s33 ] && dir=$PWD
       in_tree $dir hybrid_$name 200 python bench/bench_hybrid.py --configs tp1 tp2 --parts decode
       sed -n '/decode engine step/,/tp2 \/ tp1/p' $OUT/hybrid_$name.log | grep -E "^ +tp[12] "
       cp $dir/bench/results/bench_hybrid.json $OUT/hybrid_$name.json
     done
     GPU_CHECK_FILES=single \
       bash scripts/gpu_check.sh "tests skinny small_ops models_hf mamba graph_runners" ;;
  f) GPU_CHECK_FILES=multi GPU_CHECK_K="qwen3-32b-tp4" bash scripts/gpu_check.sh tests ;;
  d) run probe 300 python bench/results/s32/step_times_probe.py 8
     grep round $OUT/probe.log ;;
  *) echo "usage: $0 a|b|c|d"; exit 2 ;;
esac

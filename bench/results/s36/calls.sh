#!/bin/bash
# Session 36's device calls (two H200s, `nvidia-h200-x2`): bash bench/results/s36/calls.sh a|...
#   a  on main with the epilogue all-reduce merged: the all-reduce kernel tests (now also
#      fp16 negative zeros), the MoE splits in every graph mode, then bench_moe decode at
#      tp1, tp2 and ep2-allreduce; logs in $OUT/logs.tgz
#   b  four GPUs (`nvidia-h100-x4`): qwen3-32b split four ways in every graph mode (its o and
#      down projections take the epilogue send at four ranks), s32's per-step probe at tp2
#      and tp4 (any slow steps left at four ranks?), bench_multi_gpu's tp4 decode
#   d  another two-H200 machine: bench_hybrid decode twice and bench_tp decode once, tp1 and
#      tp2 in each run (issue 17's ratio on a second machine)
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
case "$1" in
  a) run kernels 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py
     run moe_multi 330 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "qwen3_moe or qwen3-30b-a3b" tests/test_multi_gpu.py
     run moe_bench 240 python bench/bench_moe.py --configs tp1 tp2 ep2-allreduce --parts decode
     cp bench/results/bench_moe.json $OUT/ 2>/dev/null
     grep -E "^ +(tp|ep)[0-9].* [0-9.]+ |batch 1" $OUT/moe_bench.log ;;
  b) run multi4 230 python -m pytest -q -m gpu -p no:cacheprovider -k qwen3-32b-tp4 \
       tests/test_multi_gpu.py
     run probe4 180 python bench/results/s32/step_times_probe.py 2 nemotron-h-8b 2,4
     tail -8 $OUT/probe4.log
     run bench4 160 python bench/bench_multi_gpu.py --configs qwen3-32b-tp4 --parts decode
     cp bench/results/bench_multi_gpu.json $OUT/ 2>/dev/null
     grep -E "qwen3-32b-tp4 +[0-9]+ " $OUT/bench4.log ;;
  d) for name in h1 t1 h2; do
       bench=$([ ${name:0:1} = h ] && echo bench_hybrid || echo bench_tp)
       run $name 200 python bench/$bench.py --configs tp1 tp2 --parts decode
       cp bench/results/$bench.json $OUT/$name.json
       grep -E "^ +tp[0-9] +[0-9]+ +[0-9.]+ |decode step at batch 1: [0-9]" $OUT/$name.log
     done ;;
  *) echo "usage: $0 a|b|d"; exit 2 ;;
esac
tar czf $OUT_ALL/logs.tgz -C $OUT .

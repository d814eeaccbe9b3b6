#!/bin/bash
# Session 34's device calls: bash bench/results/s34/calls.sh a|b|c|d|e
# a-c apply stall_trace.diff, which applies on main before the fix (da19535) only.
#   a  (two GPUs) the tp2 decode stalls: s34/stall_trace.diff's per-step channel and GPU
#      traces at batch 64 on nemotron-h-8b, with the channel's head at 4 KiB and at 64 KiB,
#      and with NCCL instead of the custom all-reduce; one JSON a variant    (about 250 s)
source bench/results/hang_s29/common.sh
case "$1" in
  a) git apply bench/results/s34/stall_trace.diff || exit 1
     for variant in "4096" "65536" "4096 nocar"; do
       set -- $variant; name=inline_$1${2:+_$2}; dir=/tmp/$name; mkdir -p $dir
       STALL_TRACE=$dir STALL_INLINE=$1 STALL_NO_CAR=$2 run $name 200 \
         python bench/results/s34_stall_probe.py 3 nemotron-h-8b 2
       grep round $OUT/$name.log
       python -c "import json,glob,sys; json.dump({f.split('/')[-1]: json.load(open(f)) for f in glob.glob('$dir/*.json')}, open('$OUT/$name.json','w'))"
     done ;;
  b) git apply bench/results/s34/stall_trace.diff || exit 1
     mkdir -p /tmp/tr; STALL_TRACE=/tmp/tr STALL_INLINE=65536 STALL_PROFILE=1 run profile 240 \
       python bench/results/s34_stall_probe.py 1 nemotron-h-8b 2
     grep round $OUT/profile.log; ls -la /tmp/tr
     python bench/results/s34/long_kernels.py /tmp/tr/prof_rank*.json > $OUT/long_kernels.txt 2>&1
     head -70 $OUT/long_kernels.txt ;;
  c) git apply bench/results/s34/stall_trace.diff || exit 1
     for variant in "65536 1024" "65536 1073741824" "4096 1073741824"; do
       set -- $variant; name=inline_$1_poll_$2; mkdir -p /tmp/$name
       STALL_TRACE=/tmp/$name STALL_INLINE=$1 STALL_POLL=$2 run $name 150 \
         python bench/results/s34_stall_probe.py 2 nemotron-h-8b 2
       grep round $OUT/$name.log
     done ;;
  d) # the fix (RELEASE_POLL 2^16 and the device's note of a release): the all-reduce
     # kernel's tests, the two-GPU files, the per-step probe and issue 17's ratio (~500 s)
     run probe 150 python bench/results/s32/step_times_probe.py 2 nemotron-h-8b
     grep round $OUT/probe.log
     run hybrid 200 python bench/bench_hybrid.py --configs tp1 tp2 --parts decode
     sed -n '/decode engine step/,/tp2 \/ tp1/p' $OUT/hybrid.log | grep -v "not measured"
     GPU_CHECK_LANES=2 bash scripts/gpu_check.sh "tests kernels_all_reduce_norm custom_all_reduce symm_mem tp_engine" 2>&1 | tail -6
     GPU_CHECK_FILES=multi GPU_CHECK_K="dying" bash scripts/gpu_check.sh "tests multi_gpu" 2>&1 | tail -3 ;;
  e) # the fix's final form (the device's note read on a wait's first spin only): its tests,
     # then bench_hybrid on it, on main's kernel, on it again (A/B/A), then the probe (~320 s)
     GPU_CHECK_FILES=single bash scripts/gpu_check.sh "tests kernels_all_reduce_norm" 2>&1 | tail -1
     run car 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py
     cp bcg/kernels/all_reduce_norm.py /tmp/fix.py
     for name in 1_fix 2_main 3_fix; do
       [ $name = 2_main ] && cp bench/results/s34/all_reduce_norm_main.py.txt bcg/kernels/all_reduce_norm.py
       [ $name = 3_fix ] && cp /tmp/fix.py bcg/kernels/all_reduce_norm.py
       run hybrid_$name 150 python bench/bench_hybrid.py --configs tp1 tp2 --parts decode
       sed -n '/decode engine step/,/tp2 \/ tp1/p' $OUT/hybrid_$name.log | grep -v "not measured\|floor:\|eager"
     done
     run probe 120 python bench/results/s32/step_times_probe.py 1 nemotron-h-8b
     grep round $OUT/probe.log ;;
  *) echo "usage: $0 a|b|c|d|e"; exit 2 ;;
esac

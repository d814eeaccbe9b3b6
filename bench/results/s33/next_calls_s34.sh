#!/bin/bash
# For session 34 (s33/NEXT.md): one part per device call, on main.
#   bash bench/results/s33/next_calls_s34.sh a|b
#   a  (nvidia-h200-x2, named: the issue's machine) issue 17's tp2 / tp1 with the squared ReLU,
#      twice in the call, through the new decode rounds (round_ms, rounds max/min); then
#      bench_kernels on nemotron-h-8b (its first run since the layer-count fix)  (about 300 s)
#   b  (two GPUs) s32's per-step probe on nemotron-h-8b (tp1, tp2), then the one-GPU
#      files the session's CPU-only changes touch (engine, server, CLI)       (about 400 s)
source bench/results/hang_s29/common.sh
case "$1" in
  a) for round in 1 2; do
       run hybrid_$round 240 python bench/bench_hybrid.py --configs tp1 tp2 --parts decode
       sed -n '/decode engine step/,/tp2 \/ tp1/p' $OUT/hybrid_$round.log
       cp bench/results/bench_hybrid.json $OUT/hybrid_$round.json
     done
     run kernels 120 python bench/bench_kernels.py --models nemotron-h-8b --label s34
     tail -4 $OUT/kernels.log ;;
  b) run probe 240 python bench/results/s32/step_times_probe.py 4 nemotron-h-8b
     grep round $OUT/probe.log
     GPU_CHECK_FILES=single bash scripts/gpu_check.sh "tests engine_generate graph_runners models_hf" ;;
  *) echo "usage: $0 a|b"; exit 2 ;;
esac

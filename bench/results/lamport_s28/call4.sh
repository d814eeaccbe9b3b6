#!/bin/bash
# Session 28, call 4 (two GPUs): the two-phase, 32-program Lamport kernel: its tests, the tiny
# models with the flag, qwen3-8b decode tp1 / tp2-custom, and its latency beside NCCL's.
source bench/results/hang_s29/common.sh  # (as run, this call carried its own copy)
run kernels 60 python -m pytest -q -rA tests/test_kernels_all_reduce_norm.py
run custom 90 python -m pytest -q -rA tests/test_custom_all_reduce.py -p no:faulthandler
run symm 90 python -m pytest -q -rA tests/test_symm_mem.py -p no:faulthandler
run multi 150 python -m pytest -q -rA tests/test_multi_gpu.py -k "tiny-qwen3-tp2 or second_engine and custom"
run tp 110 python bench/bench_tp.py --configs tp1 tp2-custom --parts decode --repeats 1
cp bench/results/bench_tp.json $OUT/ 2>/dev/null; grep -A8 "x floor" $OUT/tp.log; grep "decode step at batch 1" $OUT/tp.log
run all_reduce 60 python bench/bench_all_reduce.py
cp bench/results/bench_all_reduce.json $OUT/ 2>/dev/null; grep -A17 "µs per call" $OUT/all_reduce.log

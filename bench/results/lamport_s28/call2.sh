#!/bin/bash
# Session 28, call 2 (two GPUs): the Lamport-style custom all-reduce kernel: its tests, its
# latency beside NCCL's, rank 0's kernels at tp2-custom, and qwen3-8b decode tp1/tp2/tp2-custom.
source bench/results/hang_s29/common.sh  # (as run, this call carried its own copy)
run kernels 120 python -m pytest -q -rA tests/test_kernels_all_reduce_norm.py
run custom 150 python -m pytest -q -rA tests/test_custom_all_reduce.py -p no:faulthandler
run symm 150 python -m pytest -q -rA tests/test_symm_mem.py -p no:faulthandler
run all_reduce 150 python bench/bench_all_reduce.py
cp bench/results/bench_all_reduce.json $OUT/ 2>/dev/null; grep -A17 "µs per call" $OUT/all_reduce.log
run profile 120 python bench/results/tp_profile_s28/profile_tp.py tp2-custom
grep -v "^\[" $OUT/profile.log | grep -E "==|us avg" | head -8
run tp 200 python bench/bench_tp.py --configs tp1 tp2 tp2-custom --parts decode --repeats 1
cp bench/results/bench_tp.json $OUT/ 2>/dev/null; grep -B2 -A12 "decode" $OUT/tp.log | tail -30

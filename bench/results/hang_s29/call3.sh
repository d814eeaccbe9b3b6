#!/bin/bash
# Session 29, call 3 (two GPUs): the kernel with the count fix and the release word
# (release_waits merged): its two-GPU tests, a worker dying mid-step under the flag, the
# tiny split models, then qwen3-8b decode tp1 against tp2 with the flag.
source bench/results/hang_s29/common.sh
run kernels 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py
run custom 90 python -m pytest -q -p no:cacheprovider tests/test_custom_all_reduce.py
run multi 200 python -m pytest -q -rA -p no:cacheprovider tests/test_multi_gpu.py -k "dying or tiny-qwen3-tp2 or second_engine"
run tp 200 python bench/bench_tp.py --configs tp1 tp2-custom --parts decode --repeats 1
cp bench/results/bench_tp.json $OUT/bench_tp.json; grep "decode step at batch 1" $OUT/tp.log

#!/bin/bash
# For the next session (two GPUs, about 6 minutes): release_and_shared_norm.diff, applied
# first (git apply bench/results/hang_s29/release_and_shared_norm.diff; this script stops
# without it). A failed worker's rank 0 ends its own waits by overwriting its signals with
# RELEASED through a copy from pinned memory on a stream made beforehand (no kernel to load
# while one spins: lazy loading may wait for the spinning kernel; a suspect for the hang of
# release_waits_on_fix.diff's fill_), and the wait reads no second word (that one's extra
# atomic slowed the step to 0.647 x tp1). Hung tests leave their stacks (faulthandler).
grep -q RELEASED bcg/kernels/all_reduce_norm.py || { echo "apply release_and_shared_norm.diff first"; exit 1; }
source bench/results/hang_s29/common.sh
PYTEST="python -m pytest -q -rA -p no:cacheprovider -o faulthandler_timeout=50"
run kernels 60 $PYTEST tests/test_kernels_all_reduce_norm.py
run custom 90 $PYTEST tests/test_custom_all_reduce.py
run symm 90 $PYTEST tests/test_symm_mem.py
run tp 150 python bench/bench_tp.py --configs tp1 tp2-custom --parts decode --repeats 1
cp bench/results/bench_tp.json $OUT/bench_tp.json; grep "decode step at batch 1" $OUT/tp.log
run multi 180 $PYTEST tests/test_multi_gpu.py -k "dying or tiny-qwen3-tp2 or second_engine"

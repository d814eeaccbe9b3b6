#!/bin/bash
# Session 30, call 4 (two GPUs): test_multi_gpu.py's split tiny models in every graph mode
# (its second-engine tests passed in call 2, test_symm_mem.py in call 1, on this code); then
# where rank 0 stops when a worker dies mid-step, under NCCL and the custom all-reduce.
source bench/results/hang_s29/common.sh
run tiny 300 python -m pytest -q -p no:cacheprovider tests/test_multi_gpu.py -k "tiny"
for mode in nccl custom; do
    run probe_$mode 55 python bench/results/s30/dying_probe.py $mode
    grep PROBE $OUT/probe_$mode.log
done

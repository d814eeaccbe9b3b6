#!/bin/bash
# Session 29, call 2 (two GPUs): main's kernel with the epoch store moved after the wait's
# barrier (the race: a warp that loaded a row's count after thread 0 stored it took the next
# call's parity, so it waited for good), then the one-phase Lamport kernel with the same fix.
source bench/results/hang_s29/common.sh  # (as run, call 2 carried its own copy)
checks() {  # prefix
    export PYTHONPATH=/tmp/site:$PWD
    run $1_probe 60 python bench/results/lamport_s28/hang_probe.py fused+late+free+random+nccl
    grep rows $OUT/$1_probe.log | tail -1
    run $1_kernels 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py
    run $1_custom 120 python -m pytest -q -p no:cacheprovider tests/test_custom_all_reduce.py
    run $1_symm 120 python -m pytest -q -p no:cacheprovider tests/test_symm_mem.py
}
root=$PWD
checks main
cp -r $root /tmp/lamtree && cd /tmp/lamtree && patch -s -p1 < bench/results/hang_s29/lamport_epoch_fixed_code.diff
checks lamport
run lamport_tp 200 python bench/bench_tp.py --configs tp2-custom --parts decode --repeats 1
cp bench/results/bench_tp.json $OUT/lamport_bench_tp.json; grep -B2 -A12 "decode" $OUT/lamport_tp.log | tail -16
cd $root
run main_tp 200 python bench/bench_tp.py --configs tp1 tp2-custom --parts decode --repeats 1
cp bench/results/bench_tp.json $OUT/main_bench_tp.json; tail -16 $OUT/main_tp.log

#!/bin/bash
# Session 30, call 2 (two GPUs): is release_and_shared_norm.diff's 3.962 ms (call 1) against
# session 29's 3.782 ms for tp2-custom at batch 1 the patch or the machine? Interleaved on one
# machine: main (patch taken out), the patch, main + ar_prefetch.diff at 16 MiB in both
# shapes. Then the multi-GPU tests call 1 cut off, verbose so each result shows as it comes.
source bench/results/hang_s29/common.sh
rm -rf /tmp/base /tmp/pf
cp -r . /tmp/base && (cd /tmp/base && patch -s -R -p1 < bench/results/hang_s29/release_and_shared_norm.diff) || exit 1
cp -r /tmp/base /tmp/pf && (cd /tmp/pf && patch -s -p1 < bench/results/hang_s29/ar_prefetch.diff) || exit 1
bench() {  # name tree [prefetch]
    local name=$1 tree=$2
    run $name 110 env PYTHONPATH=/tmp/site:$tree BCG_AR_PREFETCH=${3:-} bash -c \
        "cd $tree && python bench/bench_tp.py --configs tp2-custom --parts decode --repeats 1"
    grep -E "^ *tp2-custom +(1|8|64) " $OUT/$name.log | head -3
}
run pf_custom 60 env PYTHONPATH=/tmp/site:/tmp/pf bash -c "cd /tmp/pf && python -m pytest -q -p no:cacheprovider tests/test_custom_all_reduce.py"
bench base1 /tmp/base
bench patch1 $PWD
bench pf_rows /tmp/pf 16,rows
bench pf_head /tmp/pf 16,head
bench base2 /tmp/base
bench patch2 $PWD
run multi 160 python -m pytest -v -p no:cacheprovider -o faulthandler_timeout=120 tests/test_multi_gpu.py -k "dying or second_engine"
grep -E "PASSED|FAILED|ERROR" $OUT/multi.log | cut -c1-160

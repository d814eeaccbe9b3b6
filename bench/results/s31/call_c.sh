#!/bin/bash
# Session 31, call C (two GPUs): wip.diff (tp_failure_v3 with the release moved to a flag in
# pinned memory that the kernel's waits poll, plus the collectives' warm-up at init). The
# tests of the changed code, the custom probe, main against the patch for tp2-custom decode,
# then the dying tests last (a hang there is cut by pytest-timeout).
source bench/results/hang_s29/common.sh
rm -rf /tmp/base && cp -r . /tmp/base && (cd /tmp/base && patch -s -R -p1 < bench/results/s31/wip.diff) || exit 1
PYTEST="python -m pytest -q -p no:cacheprovider --timeout=150 --timeout-method=thread"
run second 150 $PYTEST tests/test_multi_gpu.py -k second_engine
run kernels 60 $PYTEST tests/test_kernels_all_reduce_norm.py
run custom 90 $PYTEST tests/test_custom_all_reduce.py
run probe_custom 80 python bench/results/s31/dying_probe3.py custom all
grep PROBE $OUT/probe_custom.log
bench() {  # name tree
    run $1 110 env PYTHONPATH=/tmp/site:$2 bash -c \
        "cd $2 && python bench/bench_tp.py --configs tp2-custom --parts decode --repeats 1"
    grep -E "^ *tp2-custom +(1|8|64) " $OUT/$1.log | head -3
}
bench base1 /tmp/base
bench patch1 $PWD
run dying 220 python -m pytest -v -p no:cacheprovider --timeout=100 --timeout-method=thread tests/test_multi_gpu.py -k dying
grep -E "PASSED|FAILED|ERROR|Timeout" $OUT/dying.log | cut -c1-160

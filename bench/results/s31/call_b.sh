#!/bin/bash
# Session 31, call B (two GPUs): tp_failure_v3.diff plus the collectives' warm-up at init.
source bench/results/hang_s29/common.sh
run probe_custom 90 python bench/results/s31/dying_probe3.py custom all
grep PROBE $OUT/probe_custom.log
PROBE_EXIT=normal run probe_nccl_exit 90 timeout 80 python bench/results/s31/dying_probe3.py nccl all
grep PROBE $OUT/probe_nccl_exit.log
PROBE_EXIT=normal PROBE_ABORT_WAIT=0.01 run probe_abandon_exit 90 timeout 80 python bench/results/s31/dying_probe3.py nccl all
grep -E "PROBE|abandon|refuse" $OUT/probe_abandon_exit.log | cut -c1-200
run dying 220 python -m pytest -v -p no:cacheprovider --timeout=100 --timeout-method=thread tests/test_multi_gpu.py -k dying
grep -E "PASSED|FAILED|ERROR|Timeout" $OUT/dying.log | cut -c1-160
PYTEST="python -m pytest -q -p no:cacheprovider --timeout=150 --timeout-method=thread"
run symm 100 $PYTEST tests/test_symm_mem.py
run second 150 $PYTEST tests/test_multi_gpu.py -k second_engine

#!/bin/bash
# Session 30, call 3 (two GPUs): a worker dying mid-step under NCCL and under the custom
# all-reduce (with the release), stacks dumped by pytest-timeout if one hangs and the GPUs'
# load logged meanwhile; then the one-GPU test files of the GPU suite, two lanes.
source bench/results/hang_s29/common.sh
(for i in $(seq 30); do nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader | tr '\n' ' '; echo; sleep 5; done > $OUT/gpu_load.log) &
load=$!
run dying 170 python -m pytest -v -s -p no:cacheprovider --timeout=75 --timeout-method=thread tests/test_multi_gpu.py -k dying
grep -E "PASSED|FAILED|ERROR|Timeout" $OUT/dying.log | cut -c1-160
kill $load
GPU_CHECK_LANES=2 GPU_CHECK_FILES=single timeout 400 bash scripts/gpu_check.sh tests > $OUT/suite.log 2>&1
echo "suite rc $?"; sed -n '/=== summary/,$p' $OUT/suite.log; grep -E "^(FAILED|ERROR)" $OUT/suite.log | head

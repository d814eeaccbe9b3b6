#!/bin/bash
# For session 31 (two GPUs, about 5 minutes), with tp_failure_v3.diff applied (this script
# stops without it): a worker dying mid-step under NCCL, then under the custom all-reduce.
# dying_probe2.py prints when the failure, the release, the abort and the step's end came,
# what rank 0's own signals hold after the release, and every thread's stack if the step or
# close() is not back in time; then the GPU tests of the same.
grep -q "_leave_group" bcg/distributed/launcher.py || { echo "apply tp_failure_v3.diff first"; exit 1; }
source bench/results/hang_s29/common.sh
for mode in nccl custom; do
    run probe_$mode 90 python bench/results/s30/dying_probe2.py $mode all
    grep PROBE $OUT/probe_$mode.log
done
run dying 220 python -m pytest -v -p no:cacheprovider --timeout=100 --timeout-method=thread tests/test_multi_gpu.py -k dying
grep -E "PASSED|FAILED|ERROR|Timeout" $OUT/dying.log | cut -c1-160
PYTEST="python -m pytest -q -p no:cacheprovider --timeout=80 --timeout-method=thread"
run kernels 60 $PYTEST tests/test_kernels_all_reduce_norm.py
run custom 90 $PYTEST tests/test_custom_all_reduce.py

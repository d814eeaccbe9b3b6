#!/bin/bash
# Session 29, call 1 (two GPUs): where each rank is when the custom all-reduce's GPU test
# hangs, whether lazy module loading is the cause, then the hang probes.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpus.txt
(sleep 50; nvidia-smi > $OUT/smi_during_stacks.txt) &
DUMP_AFTER=40 timeout -k 5 70 python bench/results/hang_s29/hang_stacks.py > $OUT/stacks.log 2>&1
echo "stacks rc $?"; grep -c done $OUT/stacks.log; tail -3 $OUT/stacks.log
wait
CUDA_MODULE_LOADING=EAGER timeout -k 5 150 python -m pytest -q -x -p no:cacheprovider \
    tests/test_custom_all_reduce.py -k two_gpus > $OUT/eager_loading.log 2>&1
echo "eager-loading test rc $?"; tail -2 $OUT/eager_loading.log
for modes in late late+free random+nccl fused+fp32+late+free+random+nccl; do
    timeout -k 5 40 python bench/results/lamport_s28/hang_probe.py $modes > $OUT/probe_$modes.log 2>&1
    echo "$modes rc $?"; grep -E "rows|Error" $OUT/probe_$modes.log | tail -2
done

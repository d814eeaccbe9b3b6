#!/bin/bash
# Session 28, call 3 (two GPUs): at which row count the custom all-reduce stops finishing.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 60 python bench/results/lamport_s28/test_probe.py 2>&1 | grep -v Warning | tail -25; echo "probe rc $?"
for mode in loop; do
    timeout 45 python bench/results/lamport_s28/hang_probe.py $mode 2>&1 | grep -E "rows|Error" | tail -12
    echo "$mode rc $?"
done

#!/bin/bash
# For the next session (two GPUs, about 3 minutes): what makes the custom all-reduce's GPU
# test hang, one suspect per run (each run stops at its first hang: its last line says where).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for modes in late random+nccl late+random late+free late+random+nccl fused+fp32+late+random+nccl; do
    timeout 40 python bench/results/lamport_s28/hang_probe.py $modes 2>&1 | grep -E "rows|Error" | tail -2
    echo "$modes rc $?"
done

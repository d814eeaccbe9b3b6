#!/bin/bash
# For the next session (two GPUs, 3-5 minutes): what makes the custom all-reduce's GPU test
# hang, one suspect per run. A run that hangs ends at its timeout (rc 124); its last
# "rows N done" line says the last row count that finished.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for modes in late late+free late0+free random+nccl late+random+nccl fused+fp32+late+free+random+nccl; do
    timeout -k 5 40 python bench/results/lamport_s28/hang_probe.py $modes > $OUT/probe_$modes.log 2>&1
    echo "$modes rc $?"; grep -E "rows|Error" $OUT/probe_$modes.log | tail -2
done

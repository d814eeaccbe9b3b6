#!/bin/bash
# Session 29, call 4 (two GPUs): the GPU suite on the count fix, two lanes, then the
# several-GPU files.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader
GPU_CHECK_LANES=2 timeout -k 5 540 bash scripts/gpu_check.sh tests > $OUT/suite.log 2>&1
echo "suite rc $?"
grep -vE "^WARNING: Target" $OUT/suite.log | grep -E "passed|failed|error|gpu_check" | tail -40

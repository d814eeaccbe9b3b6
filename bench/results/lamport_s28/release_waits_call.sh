#!/bin/bash
# For a later session (two GPUs, about 6 minutes), once the hang is understood: the
# release_waits.diff patch (apply it first: git apply bench/results/lamport_s28/release_waits.diff).
# Its GPU checks: the kernel tests (the release ends a wait on the GPU too), the two-GPU tests
# of both flags, a worker dying mid-step with the custom all-reduce, and decode timing (the
# release word is read only while a wait spins).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # name timeout command...
    local name=$1 limit=$2; shift 2
    timeout -k 5 $limit "$@" > $OUT/$name.log 2>&1; echo "$name rc $?"; tail -1 $OUT/$name.log
}
run kernels 60 python -m pytest -q -rA tests/test_kernels_all_reduce_norm.py
run custom 120 python -m pytest -q -rA tests/test_custom_all_reduce.py -p no:faulthandler
run symm 120 python -m pytest -q -rA tests/test_symm_mem.py -p no:faulthandler
run multi 200 python -m pytest -q -rA tests/test_multi_gpu.py -k "dying or tiny-qwen3-tp2"
run tp 240 python bench/bench_tp.py --configs tp1 tp2-custom --parts decode --repeats 1
grep "decode step at batch 1" $OUT/tp.log

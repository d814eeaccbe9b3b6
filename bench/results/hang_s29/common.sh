# Sourced by this folder's device scripts: the wheels, the two-GPU environment (NVLink
# multicast off, as KINDS.md says) and run NAME LIMIT COMMAND..., which logs to $OUT/NAME.log
# and prints its exit status and last line.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # name timeout command...
    local name=$1 limit=$2; shift 2
    timeout -k 5 $limit "$@" > $OUT/$name.log 2>&1; echo "$name rc $?"; tail -1 $OUT/$name.log
}

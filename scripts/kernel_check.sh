#!/usr/bin/env bash
# GPU check of the Triton kernels, in one go for a lent GPU machine: every kernel test (bf16,
# large shapes, CUDA graph replay), then bench/bench_attention.py (extra args, e.g. --tune,
# go to it). Logs and the benchmark JSON land in $OUT (default /tmp/kernel_check).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kernel_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/env.log"

python3 -m pytest -q -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$out/tests.log"
tests_status=${PIPESTATUS[0]}

python3 bench/bench_attention.py "$@" 2>&1 | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}
cp bench/results/bench_attention.json "$out/" 2>/dev/null

echo "kernel_check: tests exit $tests_status, bench exit $bench_status"
exit $(( tests_status || bench_status ))

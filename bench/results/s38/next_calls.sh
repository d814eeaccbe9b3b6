#!/bin/bash
# For session 39: bash bench/results/s38/next_calls.sh   (one H100, `nvidia-h100-x1`)
#   pdl_tests.diff applied in /tmp/pdlt (the PTX check that every early kernel waits before
#   touching memory; an MoE layer launched early; the graph tests sharing one helper): its
#   test file (it changes nothing else)
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
MAIN=$PWD
rm -rf /tmp/pdlt && cp -r "$MAIN" /tmp/pdlt && (cd /tmp/pdlt &&
  git apply "$MAIN/bench/results/s38/pdl_tests.diff") || exit 1
cd /tmp/pdlt && export PYTHONPATH=/tmp/site:/tmp/pdlt
run pdl_tests 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_pdl.py
tar czf $OUT_ALL/logs.tgz -C $OUT .

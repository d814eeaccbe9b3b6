#!/bin/bash
# For session 37 (two H200s, `nvidia-h200-x2`): bash bench/results/s36/next_calls.sh a
#   a  review_mends.diff applied in /tmp/mends: the all-reduce and skinny kernels' tests,
#      the two-GPU custom all-reduce and symmetric-memory tests (their projected checks go
#      through the renamed entry), dummy nemotron-h-8b split in every graph mode and a worker
#      dying mid-step (about 330 s); then bench_hybrid decode to see no step lost
source bench/results/hang_s29/common.sh
MAIN=$PWD
rm -rf /tmp/mends && cp -r "$MAIN" /tmp/mends && (cd /tmp/mends &&
  git apply "$MAIN/bench/results/s36/review_mends.diff") || exit 1
cd /tmp/mends && export PYTHONPATH=/tmp/site:/tmp/mends
case "$1" in
  a) run kernels 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py \
       tests/test_kernels_skinny_linear.py
     run car 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py \
       tests/test_symm_mem.py
     run multi 380 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "nemotron-h-8b-tp2 or dying" tests/test_multi_gpu.py ;;
  *) echo "usage: $0 a"; exit 2 ;;
esac

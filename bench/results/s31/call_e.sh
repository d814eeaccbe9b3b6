#!/bin/bash
# Session 31, call E (two GPUs): with the memory settled before the budget is read, the
# second-engine tests; each dying test in a pytest process of its own, with what every process
# holds on the GPUs after it; the kernel tests; then one tiny split case with what is left.
source bench/results/hang_s29/common.sh
show() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' '; echo; }
PYTEST="python -m pytest -q -p no:cacheprovider --timeout=150 --timeout-method=thread"
run second 150 $PYTEST tests/test_multi_gpu.py -k second_engine; show
run dying_nccl 110 $PYTEST tests/test_multi_gpu.py -k "dying and nccl"; show
run dying_custom 110 $PYTEST tests/test_multi_gpu.py -k "dying and custom"; show
run kernels 60 $PYTEST tests/test_kernels_all_reduce_norm.py
run custom 90 $PYTEST tests/test_custom_all_reduce.py
run symm 60 $PYTEST tests/test_symm_mem.py
run tiny 200 $PYTEST tests/test_multi_gpu.py -k "tiny-qwen3-tp2"

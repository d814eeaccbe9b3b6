#!/bin/bash
# Session 40's device calls (bash bench/results/s40/calls.sh X), logs under $OUT:
#   a  one H100: the fused decode stack's GPU tests, then bench_decode (qwen3-0.6b, overlapped
#      full graphs) with the stack off / on, alternating
#   b  same machine: the kernel alone on qwen3-0.6b's shapes, variants of its tiling
#   d  one H100, buffers built at load time (call c's debug-mode failures): the stack's tests,
#      the graph runners' and the one-GPU model files
#   e  one H100, the code as merged: the stack's tests (a SmolLM2-shaped model added), the
#      engine's and overlap's, then bench_decode with the stack off / on, alternating (JSON)
#   c  one H100, the final kernel: its GPU tests, decode attention's and PDL's, the one-GPU
#      model and runner files, then bench_decode with the stack off / on, alternating
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
decode() {  # model switch round
  BCG_DECODE_STACK=$2 run ${1}_s$2_$3 200 python bench/bench_decode.py --models $1 \
    --modes "full graph, overlapped" --label s$2
  grep -hE "^\| ?$1|^$1 " $OUT/${1}_s$2_$3.log | sed "s/^/stack=$2 /"
}
case "$1" in
  a) run stack_tests 300 python -m pytest -q -x -p no:cacheprovider tests/test_decode_stack_gpu.py
     tail -30 $OUT/stack_tests.log
     for round in 1 2; do for s in 0 1; do decode qwen3-0.6b $s $round; done; done ;;
  b) run micro 300 python bench/results/s40/stack_micro.py $VARIANTS; cat $OUT/micro.log
     run micro_nobarrier 120 python bench/results/s40/stack_micro.py "no barrier"
     cat $OUT/micro_nobarrier.log ;;
  c) run stack_tests 200 python -m pytest -q -p no:cacheprovider tests/test_decode_stack_gpu.py \
       tests/test_kernels_decode_attention.py tests/test_kernels_pdl.py
     run runners 330 python -m pytest -q -p no:cacheprovider tests/test_graph_runners_gpu.py \
       tests/test_engine_generate.py tests/test_overlap.py
     for round in 1 2; do for s in 0 1; do decode qwen3-0.6b $s $round; done; done ;;
  d) run stack_tests 150 python -m pytest -q -p no:cacheprovider tests/test_decode_stack_gpu.py
     run runners 300 python -m pytest -q -p no:cacheprovider tests/test_graph_runners_gpu.py
     run models_hf 130 python -m pytest -q -p no:cacheprovider -m gpu tests/test_models_hf.py \
       tests/test_graph_gpu.py ;;
  e) run stack_tests 200 python -m pytest -q -p no:cacheprovider tests/test_decode_stack_gpu.py \
       tests/test_engine_generate.py tests/test_overlap.py
     for round in 1 2; do for s in 0 1; do decode qwen3-0.6b $s $round; done; done
     cp bench/results/bench_decode_s*.json $OUT/ ;;
esac
tar czf $OUT_ALL/logs.tgz -C /tmp/out .

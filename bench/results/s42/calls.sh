#!/bin/bash
# Session 42's device calls (bash bench/results/s42/calls.sh X), logs under $OUT:
#   a  one H100: the fused decode stack with Qwen3-MoE layers: its GPU tests and the MoE
#      pieces' kernel tests; then bench_moe tp1 decode with the stack off (BCG_DECODE_STACK=0)
#      and on, alternating
#   b  one H100: the stack alone on 8 of qwen3-30b-a3b's layers and on a dense layer of the
#      same sizes, timed and traced phase by phase (stack_micro.py)
#   c  one H100: the stack alone, weight chunks in registers or 3, 4, 6 in flight through
#      shared memory (pipelined tensor-core loops), on 8 MoE layers and 8 qwen3-0.6b layers
#   d  one H100: the same with each next input chunk loaded beside the next weight chunk;
#      traced with and without the top-k; qwen3-0.6b layers beside main's kernel
#   e  one H100: one projection phase alone (phase_micro.py): registers or pipelined chunks
#      of several widths on the mixture's QKV, o, gate/up and down, and the top-k alone
#   f  one H100: the stack alone on 8 MoE layers with the top-k ranking against 16 experts
#      at a time; weight chunks in registers, or the QKV's pipelined (stack_micro.py)
#   g  one H100: the sum of each token's expert outputs inside the norm's launch
#      (sum_add_rms_norm): GPU tests of the kernels and the MoE models; bench_moe tp1 decode,
#      main (main_tree/, `git archive 5275cad bcg`, removed after the call) then the change
#   h  one H100, after the zero-token path of fused_experts moved into _sum_choices: the
#      gpu-marked tests of the MoE kernel, the small ops and the MoE model (callH/final.log;
#      run as one line: run final 200 python -m pytest -q -m gpu tests/test_kernels_fused_moe.py
#      tests/test_kernels_small_ops.py tests/test_models_qwen3_moe.py)
source bench/results/hang_s29/common.sh
case "$1" in
  a) run stack_tests 420 python -m pytest -q -x -p no:cacheprovider \
       tests/test_kernels_decode_stack_moe.py tests/test_decode_stack_gpu.py
     tail -5 $OUT/stack_tests.log
     if grep -q " passed" $OUT/stack_tests.log && ! grep -q "failed" $OUT/stack_tests.log; then
       cp bench/results/bench_moe.json /tmp/bench_moe_before.json
       for stack in 0 1; do
         BCG_DECODE_STACK=$stack run moe_stack$stack 400 python bench/bench_moe.py \
           --configs tp1 --parts decode
         grep -E "^ +tp1 " $OUT/moe_stack$stack.log | sed "s/^/stack=$stack /"; done
       cp bench/results/bench_moe.json $OUT/
     fi ;;
esac
case "$1" in
  b) for ctx in 256; do run micro$ctx 300 python bench/results/s42/stack_micro.py $ctx 8
       grep -E "^ctx|^trace" $OUT/micro$ctx.log; tail -3 $OUT/micro$ctx.log; done ;;
esac
case "$1" in
  c) run micro256 400 python bench/results/s42/stack_micro.py 256 8
     grep -E "^ctx|^trace|max diff" $OUT/micro256.log; tail -3 $OUT/micro256.log ;;
esac
case "$1" in
  d) run micro256 400 python bench/results/s42/stack_micro.py 256 8
     grep -E "^ctx|^trace|max diff" $OUT/micro256.log; tail -3 $OUT/micro256.log ;;
esac
case "$1" in
  e) run phase 400 python bench/results/s42/phase_micro.py; cat $OUT/phase.log | grep -v "^$" ;;
esac
case "$1" in
  f) run micro256 400 python bench/results/s42/stack_micro.py 256 8
     grep -E "^ctx|^trace|max diff" $OUT/micro256.log; tail -3 $OUT/micro256.log ;;
esac
case "$1" in
  g) run moe_tests 330 python -m pytest -q -p no:cacheprovider tests/test_kernels_small_ops.py \
       tests/test_kernels_fused_moe.py tests/test_kernels_pdl.py tests/test_kernels_moe_routing.py \
       tests/test_models_qwen3_moe.py tests/test_models_hf.py "tests/test_graph_runners_gpu.py" \
       -k "moe or sum_add or rms_norm or pdl or test_kernels_fused or routing"
     tail -3 $OUT/moe_tests.log
     for v in main new; do
       if [ $v = main ]; then path=/tmp/site:$PWD/bench/results/s42/main_tree:$PWD
       else path=/tmp/site:$PWD; fi
       PYTHONPATH=$path run moe_$v 200 python bench/bench_moe.py --configs tp1 --parts decode
       grep -E "^ +tp1 +(1|8|64) " $OUT/moe_$v.log | sed "s/^/$v /"
       cp bench/results/bench_moe.json $OUT/bench_moe_$v.json; done ;;
esac

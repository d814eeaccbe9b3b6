#!/bin/bash
# Session 41's device calls (bash bench/results/s41/calls.sh X), logs under $OUT:
#   a  one H100: the stack alone with experiment flags (x one chunk ahead, per-KV-head counts
#      for QKV -> attention) and a phase-by-phase trace, at 256 and 1024 tokens; then where a
#      whole batch-1 step of qwen3-0.6b goes (profile_step.py)
#   b  same: the phase-by-phase trace alone (call a's failed on a device mismatch)
#   c  one H100: the stack alone at 256, 1024 and 5000 tokens with the first KV tile of each
#      attention item loaded before the QKV -> attention wait (PREFETCH_KV) and per-KV-head
#      counts; the stack's and attention's GPU tests with both on; bench_decode alternating
#   d  one H100: the stack alone with gate/up tiles of 24 columns (128 programs, not 96) and
#      16k-weight gate/up chunks; the stack's GPU tests with the 24-column tiles
#   e  same: those tilings with a barrier whose last arrival sets a flag the others poll with
#      acquire loads (not atomics)
#   f  one H100: the o projection cut by KV head group, each group's tiles starting once its
#      attention is done (one grid barrier a layer fewer), with 24-column gate/up tiles of
#      16k chunks, beside main's kernel (decode_stack_main.py): the stack alone at 256, 1024
#      and 5000 tokens, its GPU tests, bench_decode alternating main / new
#   g  one H100: the stack alone, main / 24-column gate/up tiles of 16k chunks / that with the
#      per-head norms' weights loaded before the barrier and the key loaded beside the query /
#      that with 16k QKV or o chunks; the stack's GPU tests
#   h  one H100, the code to land (those stack changes with o's 16k chunks, greedy argmax
#      split over programs): GPU tests of the stack, argmax, sampling, engine and overlap;
#      bench_decode alternating main (its stack, PyTorch's argmax) / new; the graph runners'
#      and one-GPU model files
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
case "$1" in
  a) run micro256 240 python bench/results/s41/stack_micro.py 256; cat $OUT/micro256.log
     run micro1024 240 python bench/results/s41/stack_micro.py 1024; cat $OUT/micro1024.log
     run profile 240 python bench/results/s41/profile_step.py; tail -25 $OUT/profile.log ;;
  b) run trace256 200 python bench/results/s41/stack_micro.py 256 --trace-only; cat $OUT/trace256.log ;;
  c) for ctx in 256 1024 5000; do run micro$ctx 240 python bench/results/s41/stack_micro.py $ctx
       grep -E "^ctx|^trace|^   " $OUT/micro$ctx.log; done
     BCG_STACK_EXPERIMENT=PREFETCH_KV,HEAD_COUNTS run stack_tests 300 python -m pytest -q \
       -p no:cacheprovider tests/test_decode_stack_gpu.py tests/test_kernels_decode_attention.py \
       tests/test_kernels_extend_attention.py
     tail -3 $OUT/stack_tests.log
     for round in 1 2; do for e in none PREFETCH_KV,HEAD_COUNTS; do
       BCG_STACK_EXPERIMENT=$e run decode_${e}_$round 200 python bench/bench_decode.py \
         --models qwen3-0.6b --modes "full graph, overlapped" --label $e
       grep -hE "^qwen3-0.6b " $OUT/decode_${e}_$round.log | sed "s/^/$e /"; done; done ;;
  d) for ctx in 256 1024; do run micro$ctx 240 python bench/results/s41/stack_micro.py $ctx
       grep -E "^ctx" $OUT/micro$ctx.log; done
     run stack_tests 300 python -m pytest -q -p no:cacheprovider tests/test_decode_stack_gpu.py
     tail -3 $OUT/stack_tests.log ;;
  e) for ctx in 256 1024; do run micro$ctx 240 python bench/results/s41/stack_micro.py $ctx
       grep -E "^ctx" $OUT/micro$ctx.log; done ;;
  f) for ctx in 256 1024 5000; do run micro$ctx 150 python bench/results/s41/stack_micro.py $ctx
       grep -E "^ctx" $OUT/micro$ctx.log; done
     run stack_tests 300 python -m pytest -q -p no:cacheprovider tests/test_decode_stack_gpu.py
     tail -3 $OUT/stack_tests.log
     for round in 1 2; do for v in main new; do
       if [ $v = main ]; then script=bench/results/s41/bench_decode_main_stack.py
       else script=bench/bench_decode.py; fi
       run decode_${v}_$round 200 python $script --models qwen3-0.6b \
         --modes "full graph, overlapped" --label $v
       grep -hE "^qwen3-0.6b " $OUT/decode_${v}_$round.log | sed "s/^/$v /"; done; done
     cp bench/results/bench_decode_*.json $OUT/ ;;
  g) for ctx in 256 1024 5000; do run micro$ctx 200 python bench/results/s41/stack_micro.py $ctx
       grep -E "^ctx" $OUT/micro$ctx.log; done
     run stack_tests 300 python -m pytest -q -p no:cacheprovider tests/test_decode_stack_gpu.py
     tail -3 $OUT/stack_tests.log ;;
  h) run stack_tests 400 python -m pytest -q -p no:cacheprovider tests/test_decode_stack_gpu.py \
       tests/test_kernels_argmax.py tests/test_sampling.py tests/test_engine_generate.py \
       tests/test_overlap.py
     tail -3 $OUT/stack_tests.log
     for round in 1 2; do for v in main new; do
       if [ $v = main ]; then script=bench/results/s41/bench_decode_main_stack.py
       else script=bench/bench_decode.py; fi
       run decode_${v}_$round 200 python $script --models qwen3-0.6b \
         --modes "full graph, overlapped" --label $v
       grep -hE "^qwen3-0.6b " $OUT/decode_${v}_$round.log | sed "s/^/$v /"; done; done
     cp bench/results/bench_decode_*.json $OUT/
     run runners 400 python -m pytest -q -p no:cacheprovider tests/test_graph_runners_gpu.py
     tail -2 $OUT/runners.log
     run models_hf 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_models_hf.py \
       tests/test_graph_gpu.py
     tail -2 $OUT/models_hf.log ;;
esac
rm -f /tmp/out/step_trace.json
tar czf $OUT_ALL/logs.tgz -C /tmp/out .

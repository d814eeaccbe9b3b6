#!/bin/bash
# Session 37's device calls: bash bench/results/s37/calls.sh a|b|c
#   a  two H200s (`nvidia-h200-x2`), the tree with s36's review_mends.diff applied: the
#      all-reduce and skinny kernels' tests, the two-GPU custom all-reduce and symmetric-memory
#      tests, dummy nemotron-h-8b split in every graph mode and a worker dying mid-step
#   b  same machine: the one-GPU test files in two lanes, then qwen3-8b split in every mode
#   c  one H100: s36's tpot probe (qwen3-0.6b, prompts of 16 / 128 / 512), then bench_decode's
#      qwen3-0.6b overlapped rows (step loop and tpot) on the same card
#   d  one H100, branch pdl-prefetch: the kernel tests with BCG_PDL=1, then bench_decode
#      (overlapped full graphs) of qwen3-0.6b and qwen3-8b with it off, PDL with each
#      projection asking L2 for its first 16 MiB of weight before it waits (pdl16), PDL alone
#      (pdl0), and (0.6b) every projection on the skinny kernel (all16)
#   e  one H100, branch pdl-prefetch without the prefetch: kernel and engine tests with
#      BCG_PDL=2, then bench_decode with BCG_PDL 0 (off), 1 (the skinny projections launched
#      early) and 2 (also the norms, rotary and decode attention), alternating
#   f  two H200s, PDL on by default: the one-GPU test files (kernels included) in two lanes,
#      the two-GPU custom all-reduce and symmetric-memory tests
#   g  same machine: dummy nemotron-h-8b and qwen3-8b split in every graph mode, a worker dying
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
case "$1" in
  a) run kernels 90 python -m pytest -q -p no:cacheprovider tests/test_kernels_all_reduce_norm.py \
       tests/test_kernels_skinny_linear.py
     run car 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py \
       tests/test_symm_mem.py
     run multi 360 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "nemotron-h-8b-tp2 or dying" tests/test_multi_gpu.py ;;
  b) GPU_CHECK_LANES=2 GPU_CHECK_FILES=single OUT=/tmp/out/suite timeout 300 bash \
       scripts/gpu_check.sh "tests graph_runners_gpu models_hf engine_generate overlap" \
       > /tmp/out/suite.log 2>&1; echo "suite rc $?"; tail -8 /tmp/out/suite.log
     run multi8 200 python -m pytest -q -m gpu -p no:cacheprovider -k qwen3-8b-tp2 \
       tests/test_multi_gpu.py ;;
  c) run probe 240 python bench/results/s36/tpot_probe.py qwen3-0.6b 256
     tail -6 $OUT/probe.log
     run decode 300 python bench/bench_decode.py --models qwen3-0.6b --modes "full graph, overlapped"
     cp bench/results/bench_decode*.json $OUT/ 2>/dev/null; grep -E "qwen3-0.6b" $OUT/decode.log | tail -4 ;;
  d) export BCG_PDL=1
     run kernels 120 python -m pytest -q -p no:cacheprovider tests/test_kernels_skinny_linear.py \
       tests/test_kernels_decode_attention.py tests/test_kernels_small_ops.py
     for model in qwen3-0.6b qwen3-8b; do
       for cfg in off pdl16 pdl0 all16; do
         [ $cfg = all16 ] && [ $model = qwen3-8b ] && continue
         BCG_PDL=$([ $cfg = off ] && echo 0 || echo 1) BCG_PREFETCH_MB=$(mb=${cfg//[a-z]/}; echo ${mb:-16}) \
           BCG_SKINNY_ALL=$([ $cfg = all16 ] && echo 1 || echo 0) \
           run ${model}_$cfg 150 python bench/bench_decode.py --models $model \
           --modes "full graph, overlapped" --label $cfg
         grep -E "^$model " $OUT/${model}_$cfg.log | sed "s/^/$cfg /"
       done
     done ;;
  e) BCG_PDL=2 run kernels2 120 python -m pytest -q -p no:cacheprovider \
       tests/test_kernels_skinny_linear.py tests/test_kernels_decode_attention.py \
       tests/test_kernels_small_ops.py
     BCG_PDL=2 run engine2 150 python -m pytest -q -m gpu -p no:cacheprovider \
       tests/test_engine_generate.py tests/test_overlap.py
     for round in 1 2; do
       for model in qwen3-0.6b qwen3-8b; do
         for mode in 0 1 2; do
           [ $round = 2 ] && [ $model = qwen3-8b ] && continue
           BCG_PDL=$mode run ${model}_pdl${mode}_$round 150 python bench/bench_decode.py \
             --models $model --modes "full graph, overlapped" --label pdl$mode
           grep -E "^$model " $OUT/${model}_pdl${mode}_$round.log | sed "s/^/pdl$mode /"
         done
       done
     done ;;
  f) GPU_CHECK_LANES=2 GPU_CHECK_FILES=single OUT=/tmp/out/suite timeout 420 bash \
       scripts/gpu_check.sh "tests kernels graph_runners_gpu models_hf engine_generate overlap" \
       > /tmp/out/suite.log 2>&1; echo "suite rc $?"; sed -n '/=== summary/,$p' /tmp/out/suite.log
     run car 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_all_reduce.py \
       tests/test_symm_mem.py ;;
  g) run multi 330 python -m pytest -q -m gpu -p no:cacheprovider -k \
       "nemotron-h-8b-tp2 or dying or qwen3-8b-tp2" tests/test_multi_gpu.py ;;
  *) echo "usage: $0 a|b|c|d|e|f|g"; exit 2 ;;
esac
tar czf $OUT_ALL/logs.tgz -C $OUT .

#!/bin/bash
# For session 39: bash bench/results/s38/next_calls.sh a|b   (one H100, `nvidia-h100-x1`)
#   a  decode_layout_probe.py (decode attention over token-major and head-major views of the
#      same cache, offline-like batches); then kv_hnd.diff applied in /tmp/hnd (the engine's
#      KV cache stored head-major, the store kernels taking strides): the kernel tests it
#      touches and the one-GPU engine tests; pdl_tests.diff applied in /tmp/pdlt (the PTX
#      check that every early kernel waits before touching memory, the MoE layer launched
#      early): its test file
#   b  same machine: offline qwen3-8b (decode + breakable, overlapped), main, the diff and
#      decode attention cutting rows into at least 4 splits (split4), twice (about 450 s)
source bench/results/hang_s29/common.sh
export OUT_ALL=$OUT OUT=/tmp/out && mkdir -p /tmp/out
MAIN=$PWD
for name in hnd:kv_hnd pdlt:pdl_tests; do
  rm -rf /tmp/${name%%:*} && cp -r "$MAIN" /tmp/${name%%:*} && (cd /tmp/${name%%:*} &&
    git apply "$MAIN/bench/results/s38/${name#*:}.diff") || exit 1
done
case "$1" in
  a) run probe 150 python bench/results/s38/decode_layout_probe.py
     cat $OUT/probe.log
     (cd /tmp/pdlt && PYTHONPATH=/tmp/site:/tmp/pdlt run pdl_tests 150 python -m pytest -q \
       -p no:cacheprovider tests/test_kernels_pdl.py)
     cd /tmp/hnd && export PYTHONPATH=/tmp/site:/tmp/hnd
     run kernels 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_decode_attention.py \
       tests/test_kernels_extend_attention.py tests/test_kernels_small_ops.py \
       tests/test_kernels_pdl.py tests/test_attention_ref.py
     run engine 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_generate.py \
       tests/test_overlap.py tests/test_models_hf.py tests/test_graph_runners_gpu.py ;;
  b) rm -rf /tmp/split4 && cp -r "$MAIN" /tmp/split4 && sed -i \
       's/num_splits = min(MAX_SPLITS, max(1, num_splits))/num_splits = min(MAX_SPLITS, max(4, num_splits))/' \
       /tmp/split4/bcg/kernels/decode_attention.py
     grep -c "max(4, num_splits)" /tmp/split4/bcg/kernels/decode_attention.py
     for round in 1 2; do
       for tree in "$MAIN" /tmp/hnd /tmp/split4; do
         name=offline_$(basename $tree)_$round
         (cd $tree && PYTHONPATH=/tmp/site:$tree run $name 150 python bench/bench_offline.py \
           --models qwen3-8b --modes "decode + breakable" --overlap on --repeats 2)
         grep -E "^qwen3-8b +decode" $OUT/$name.log | tail -1 | sed "s/^/$name /"
       done
     done ;;
  *) echo "usage: $0 a|b"; exit 2 ;;
esac
tar czf $OUT_ALL/logs.tgz -C $OUT .

#!/bin/bash
# For session 32 (one H100, at most 10 minutes): norm_prologue.diff (the residual add and the
# RMSNorm folded into the skinny projections after them, issue 18's tpot). Its kernel and
# layer tests on the GPU, the graph-runner and HF model tests, then qwen3-0.6b decode
# (full graph, overlapped: the default) main against the patch, interleaved, on one machine.
git apply --check bench/results/s31/norm_prologue.diff 2>/dev/null && git apply bench/results/s31/norm_prologue.diff
grep -q "skinny_add_rms_norm_linear" bcg/kernels/skinny_linear.py || { echo "norm_prologue.diff not applied"; exit 1; }
source bench/results/hang_s29/common.sh
rm -rf /tmp/base && cp -r . /tmp/base && (cd /tmp/base && git apply -R bench/results/s31/norm_prologue.diff) || exit 1
PYTEST="python -m pytest -q -p no:cacheprovider --timeout=200 --timeout-method=thread"
run kernels 90 $PYTEST tests/test_kernels_skinny_linear.py tests/test_skinny_linear_layers.py
run models 300 $PYTEST tests/test_graph_runners_gpu.py tests/test_models_hf.py -m gpu
bench() {  # name tree
    run $1 150 env PYTHONPATH=/tmp/site:$2 bash -c "cd $2 && python bench/bench_decode.py \
        --models qwen3-0.6b --modes 'full graph, overlapped' --label $1"
    grep -E "qwen3-0.6b" $OUT/$1.log | tail -4
    cp $2/bench/results/bench_decode_$1.json $OUT/ 2>/dev/null
}
bench base1 /tmp/base
bench patch1 $PWD
# If the call has time left (each bench about 90 s): a second pair, the machine's noise.
[ $SECONDS -lt 380 ] && bench base2 /tmp/base && bench patch2 $PWD

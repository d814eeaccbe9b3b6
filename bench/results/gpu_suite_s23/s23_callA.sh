#!/usr/bin/env bash
# Session 23 call A (nvidia-h100-x4): GPU suite's single-GPU files on GPUs 0,1 (two lanes) and
# the several-GPU files on GPUs 2,3; then bench_offline's rows (overlap on and off) on GPUs 2
# and 3, one model each. Stores the first half of the SmolLM2 GGUF in /tmp for call B.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
git log --oneline -1 2>/dev/null | cut -c1-80
nvidia-smi -L
mkdir -p /tmp/smol && cp -r build/smol_a/* /tmp/smol/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
(CUDA_VISIBLE_DEVICES=0,1 OUT=/tmp/suite timeout 560 bash scripts/gpu_check.sh \
  "tests kernels graph_gpu graph_runners engine_generate overlap sampling attention_ref models_hf" \
  > $OUT/suite.log 2>&1) &
(sleep 5; CUDA_VISIBLE_DEVICES=2,3 timeout 360 python3 -m pytest \
  tests/test_symm_mem.py tests/test_multi_gpu.py -k "symm_mem or tiny" -q -p no:cacheprovider \
  -rs --tb=short > $OUT/multi.log 2>&1
 (CUDA_VISIBLE_DEVICES=2 timeout 230 python3 bench/bench_offline.py --models qwen3-0.6b \
   --modes "decode + breakable" --overlap on off --repeats 2 > $OUT/offline_06.log 2>&1) &
 (CUDA_VISIBLE_DEVICES=3 timeout 230 python3 bench/bench_offline.py --models qwen3-8b \
   --modes "decode + breakable" --overlap on off --repeats 2 > $OUT/offline_8b.log 2>&1) &
 wait
 cp bench/results/bench_offline_qwen3-0.6b.json bench/results/bench_offline_qwen3-8b.json $OUT/) &
wait
grep -vE "^WARNING: Target" $OUT/suite.log | tail -22
echo "== multi"; tail -6 $OUT/multi.log
for f in offline_06 offline_8b; do echo "== $f"; grep -vE "capturing|Warning|warn" $OUT/$f.log | tail -8; done

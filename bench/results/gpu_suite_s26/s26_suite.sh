#!/usr/bin/env bash
# Session 26, nvidia-h100-x1: the GPU suite's single-GPU files in one lane on the one H100.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L
GPU_CHECK_LANES=1 OUT=/tmp/suite timeout 580 bash scripts/gpu_check.sh \
  "tests kernels graph_gpu graph_runners engine_generate overlap sampling attention_ref models_hf" \
  > $OUT/suite.log 2>&1
grep -vE "^WARNING: Target" $OUT/suite.log | tail -22

"""Triton kernels: paged attention, the KV-cache store and small fused ops.

One concept per module; each exposes plain functions over torch tensors:

- ``decode_attention``: one new token per sequence over the paged cache (split-KV, graph-safe)
- ``extend_attention``: a varlen batch of new tokens over a paged prefix, causal on themselves
- ``kv_store``: write new keys/values into their cache slots
- ``rmsnorm``: RMSNorm, optionally fused with the residual add
- ``rotary``: neox-style rotary embedding in place, optionally after a per-head RMSNorm
  (Qwen3's q/k norm); the cos/sin tables come from ``bcg.layers.rotary``
- ``activation``: SiLU-and-mul
- ``skinny_linear``: the linear layers of decode-sized steps (up to 16 rows) in one launch,
  optionally with SiLU-and-mul fused on the output (the MLP's gate/up projection)
- ``mamba_conv``: Mamba2's causal depthwise conv over a varlen batch with per-sequence conv
  state, and its one-token update (decode, graph-safe)
- ``mamba_scan``: Mamba2's chunked SSD scan over a varlen batch from and back into
  per-sequence state, and the one-token selective state update (decode, graph-safe)

On a machine without CUDA, importing this package turns on Triton's interpreter
(``TRITON_INTERPRET=1``) unless the variable is already set, so the same kernels run on CPU
tensors (slowly: tests only). Triton reads the variable when a kernel is defined, so import
``bcg.kernels`` before any module that defines Triton kernels of its own.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

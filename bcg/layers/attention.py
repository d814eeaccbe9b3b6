"""The attention op: the one place a forward pass reads per-step state, hence the graph break.

`attention(q, k, v, output, layer_id)` stores the new K/V of the live tokens into the paged
cache and writes their attention into `output` (Triton kernels on CUDA, the PyTorch
reference elsewhere). Everything that changes per step comes from
the forward context, so a breakable graph can replay it with its capture-time arguments.
Rows past the batch's real token count (graph padding) are neither read nor cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bcg.graph import eager_on_graph, is_in_breakable_cuda_graph
from bcg.layers.attention_ref import paged_attention_ref, store_kv
from bcg.runner.context import get_forward_context
from bcg.runner.forward_batch import ForwardBatch

# Imported once, not on every call: the kernels need Triton, which the reference path (and a
# CPU-only install) does without.
try:
    from bcg.kernels.decode_attention import decode_attention
    from bcg.kernels.extend_attention import extend_attention
    from bcg.kernels.kv_store import store_kv as store_kv_kernel
except ImportError:
    decode_attention = extend_attention = store_kv_kernel = None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_id: int
) -> None:
    """q, output `[T, H, D]`, k, v `[T, KVH, D]`, T >= the live token count."""
    context = get_forward_context()
    n = context.batch.num_tokens
    k_cache, v_cache = context.kv_cache.layer(layer_id)
    paged_attention(q[:n], k[:n], v[:n], k_cache, v_cache, context.batch.slot_mapping[:n],
                    context.batch, context.attention_scales[layer_id], output[:n],
                    use_kernels=q.is_cuda, decode_plan=context.decode_plan)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    out: torch.Tensor,
    use_kernels: bool,
    decode_plan: Any = None,
) -> None:
    """Store the new K/V at their slots, then attend over the batch's sequences with the
    Triton kernels (CUDA) or the reference. All token-axis tensors hold live tokens only."""
    if not use_kernels:
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        paged_attention_ref(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                            batch.block_tables, scale, out=out)
        return
    if store_kv_kernel is None:
        raise RuntimeError("attention on CUDA needs Triton's kernels, which failed to import: "
                           "pip install triton (the version your torch was built with)")
    store_kv_kernel(k, v, k_cache, v_cache, slot_mapping)
    if batch.is_decode:
        decode_attention(q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale, out=out,
                         plan=decode_plan)
    else:
        extend_attention(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                         batch.block_tables, scale, out=out)


attention_break = eager_on_graph(attention)


def attention_call() -> Callable[..., None]:
    """The op to call now: a graph break while a breakable graph is being captured (its
    replay then runs `attention` on the live batch), else `attention` itself."""
    return attention_break if is_in_breakable_cuda_graph() else attention


@torch.compiler.disable
def attention_outside_compile(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer: Attention
) -> None:
    """What a `torch.compile`d stack calls: compilation stops here (the piecewise split), and
    at run time the op is a graph break when a breakable graph is being captured. It takes
    the layer, not its id: the compiler would specialise on the integer and recompile the
    caller once per layer (hitting its recompile limit on deep models)."""
    attention_call()(q, k, v, output, layer.layer_id)


class Attention(nn.Module):
    """Paged causal attention of one layer; q, k, v arrive already projected and rotated."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(q)
        if torch.compiler.is_compiling():
            attention_outside_compile(q, k, v, output, self)
        else:
            attention_call()(q, k, v, output, self.layer_id)
        return output

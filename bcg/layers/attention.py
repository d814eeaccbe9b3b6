"""The attention layer: paged causal attention over the per-step state in the forward
context, hence the graph break point of every model.

The layer takes the output from the bridge buffers (`bcg.graph.bridge`: what crosses a break
is shared by all layers, so the graph pool does not grow with them) and hands q, k, v and
the output to the backend the context carries. Rows past the batch's real token count
(graph padding) are neither read nor cached.
"""

from __future__ import annotations

import torch
from torch import nn

from bcg.forward import KVStore, get_forward_context
from bcg.graph import bridge_buffer
from bcg.layers.step_op import step_op


class Attention(nn.Module):
    """Paged causal attention of one layer; q, k, v arrive already projected and rotated."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_stored: bool = False) -> torch.Tensor:
        """q `[T, H, D]`, k, v `[T, KVH, D]`, T >= the live token count -> `[T, H, D]`. q, k
        and v should be views of a bridge buffer too (the model's QKV projection writes them
        there), the output is one. `kv_stored`: rotary already stored k and v where
        `kv_store_target` said."""
        output = bridge_buffer("attention_output", q.shape, q.dtype, q.device)
        if output is None:
            output = torch.empty_like(q)
        attend(self, q, k, v, output, kv_stored)
        return output


def kv_store_target(layer: Attention, v: torch.Tensor) -> KVStore | None:
    """Where rotary may store this step's k and `v` itself, as the backend allows (never
    inside a compiled stack, whose kernels are the compiler's)."""
    if torch.compiler.is_compiling():
        return None
    context = get_forward_context()
    return context.attention.kv_store_target(layer, v, context)


def _attend(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            output: torch.Tensor, kv_stored: bool) -> None:
    context = get_forward_context()
    n = context.batch.num_tokens
    context.attention.forward(layer, q[:n], k[:n], v[:n], output[:n], context, kv_stored)


attend = step_op(_attend)

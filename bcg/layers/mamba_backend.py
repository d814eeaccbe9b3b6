"""Mamba2 backends: the causal conv and the SSM scan of a step over the state cache, chosen
once when the engine starts (as attention's backends are).

A decode batch (every sequence one token: also each decode graph's static batch) takes the
one-token conv update and the selective state update; any other batch the varlen conv and
the chunked scan (a decode row there is a sequence of one token with its state). The same
four ops come in two implementations: our Triton kernels on CUDA, the PyTorch reference
elsewhere (the CPU path and the tests' oracle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from bcg.forward import ForwardContext
from bcg.graph import bridge_buffer
from bcg.layers import mamba_ref, triton_ops


class DepthwiseConvWeights(Protocol):
    weight: torch.Tensor  # [conv_dim, K]
    bias: torch.Tensor | None  # [conv_dim]


class MambaLayer(Protocol):
    state_index: int
    num_heads: int  # this rank's
    n_groups: int
    head_dim: int
    state_size: int
    chunk_size: int
    dt_limit: tuple[float, float]
    inner_size: int
    conv_dim: int
    conv1d: DepthwiseConvWeights
    dt_bias: torch.Tensor
    A: torch.Tensor  # -exp(A_log), fp32
    D: torch.Tensor


class MambaOps(NamedTuple):
    """The four state ops, with `bcg.layers.mamba_ref`'s signatures."""

    conv: Callable[..., None]
    conv_update: Callable[..., None]
    scan: Callable[..., None]
    state_update: Callable[..., None]


REFERENCE_OPS = MambaOps(mamba_ref.causal_conv1d_ref, mamba_ref.causal_conv1d_update_ref,
                         mamba_ref.ssd_scan_ref, mamba_ref.selective_state_update_ref)


class MambaBackend:
    def __init__(self, ops: MambaOps) -> None:
        self.ops = ops

    def forward(self, layer: MambaLayer, projected: torch.Tensor, out: torch.Tensor,
                context: ForwardContext) -> None:
        """projected `[T, z | x | B | C | dt]`, out `[T, inner]`, T the live token count:
        conv and scan each sequence from its state slot, write y (with the D skip, before
        the gate) into `out` and the final states back into the slots."""
        batch = context.batch
        conv_state, ssm_state = context.state_cache.layer(layer.state_index)
        start = layer.inner_size
        xbc = projected[:, start : start + layer.conv_dim]
        dt = projected[:, start + layer.conv_dim :]
        activated = bridge_buffer("mamba_activated", xbc.shape, xbc.dtype, xbc.device)
        if activated is None:
            activated = torch.empty(xbc.shape, dtype=xbc.dtype, device=xbc.device)
        weight, bias = layer.conv1d.weight, layer.conv1d.bias
        if batch.is_decode:
            self.ops.conv_update(xbc, weight, bias, conv_state, batch.seq_lens,
                                 batch.state_slots, activated)
        else:
            self.ops.conv(xbc, weight, bias, conv_state, batch.cu_seqlens_q, batch.seq_lens,
                          batch.state_slots, activated)
        tokens, groups_size = xbc.shape[0], layer.n_groups * layer.state_size
        x, B, C = activated.split([layer.inner_size, groups_size, groups_size], dim=-1)
        x = x.view(tokens, layer.num_heads, layer.head_dim)
        B = B.view(tokens, layer.n_groups, layer.state_size)
        C = C.view(tokens, layer.n_groups, layer.state_size)
        y = out.view(tokens, layer.num_heads, layer.head_dim)
        if batch.is_decode:
            self.ops.state_update(x, dt, layer.A, B, C, layer.D, layer.dt_bias, layer.dt_limit,
                                  ssm_state, batch.seq_lens, batch.state_slots, y)
        else:
            # No chunk longer than the batch's longest sequence: the rest would be padding.
            chunk_size = min(layer.chunk_size, batch.max_seqlen_q)
            self.ops.scan(x, dt, layer.A, B, C, layer.D, layer.dt_bias, layer.dt_limit,
                          chunk_size, ssm_state, batch.cu_seqlens_q, batch.seq_lens,
                          batch.state_slots, y)


def mamba_backend(device: torch.device) -> MambaBackend:
    """Triton's kernels on CUDA, the PyTorch reference elsewhere."""
    if triton_ops.uses_triton(device):
        return MambaBackend(MambaOps(triton_ops.causal_conv1d_varlen,
                                     triton_ops.causal_conv1d_update,
                                     triton_ops.ssd_scan_varlen,
                                     triton_ops.selective_state_update))
    return MambaBackend(REFERENCE_OPS)

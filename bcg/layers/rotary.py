"""Rotary position embedding (rotate-half layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from bcg.forward import KVStore
from bcg.layers import triton_ops
from bcg.layers.norm import RMSNorm
from bcg.layers.triton_ops import use_fused_kernels

SUPPORTED_ROPE_TYPES = ("default", "llama3")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
        kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, H, D]` and k `[T, KVH, D]` by their token positions `[T]`, after
        normalising each head with `norms` (q's, k's) if given, then store k and v where
        `kv_store` says (only the fused kernel, offered it by the attention backend). In
        place with the fused kernel, which does it all in one launch."""
        if use_fused_kernels(q):
            weights = None if norms is None else (norms[0].weight, norms[1].weight)
            eps = 0.0 if norms is None else norms[0].eps
            triton_ops.apply_rotary(q, k, positions, self.cos, self.sin, weights, eps,
                                    kv_store)
            return q, k
        assert kv_store is None, "only the fused kernel stores k and v"
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)

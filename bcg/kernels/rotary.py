"""Rotary position embedding, neox style (rotate halves, as HF Llama/Qwen), in place.

The cos/sin tables are the caller's: ``bcg.layers.rotary.RotaryEmbedding`` builds them
(``.cos`` and ``.sin``, fp32 ``[max_position, head_dim // 2]``) with any Llama-3 frequency
scaling already applied, so the kernel only looks them up by position.

Qwen3 normalises each q and k head (RMSNorm over ``head_dim``) right before rotating it; given
``norm_weights`` the kernel does both in one pass, rounding exactly as the ``rms_norm``
kernel followed by this one without norms. Given ``kv_store`` it also writes the rotated k
and v into the paged cache, as ``store_kv`` would: a decode step then skips that launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.forward import KVStore
from bcg.kernels import _pdl
from bcg.kernels._launch import (
    CachedLauncher,
    next_power_of_2,
    require_last_dim_contiguous,
)
from bcg.kernels.kv_store import check_kv_store


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
    kv_store: KVStore | None = None,
) -> None:
    """Rotate ``q`` and ``k`` in place by their tokens' positions.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, last dim contiguous (a view into a fused
            qkv tensor is fine).
        k: ``[num_tokens, num_kv_heads, head_dim]``, same.
        positions: int64 ``[num_tokens]``, each ``< max_position``.
        cos, sin: fp32 ``[max_position, head_dim // 2]``, last dim contiguous.
        norm_weights: ``(q_weight, k_weight)``, each ``[head_dim]``: RMS-normalise every head
            first (``weight * x / rms(x)``), as ``RMSNorm`` would.
        eps: added to each head's mean square when normalising (one value for q and k, as
            Qwen3's two norms share it).
        kv_store: ``(v, k_cache, v_cache, slot_mapping)``: also store the rotated k and v at
            ``slot_mapping`` (a negative slot writes nothing), with ``store_kv``'s layouts.

    The rotation is computed in fp32 and rounded once. One launch, no host synchronisation.
    """
    num_tokens, num_heads, head_dim = q.shape
    half = head_dim // 2
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or cos.shape[1:] != (half,):
        raise ValueError(
            f"expected q [T, H, D], k [T, KVH, D], cos/sin [max_position, D/2]; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}"
        )
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same shape and strides")
    if half & (half - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    q_weight, k_weight = norm_weights if norm_weights is not None else (cos, cos)
    if norm_weights is not None and (q_weight.shape, k_weight.shape) != ((head_dim,),) * 2:
        raise ValueError(f"norm weights must be [head_dim={head_dim}], got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    tensors = (("q", q), ("k", k), ("cos", cos), ("q_weight", q_weight), ("k_weight", k_weight))
    for name, tensor in tensors:
        require_last_dim_contiguous(name, tensor)
    # Without a store the kernel never reads these pointers; k stands in for them.
    v, k_cache, v_cache, slots = kv_store if kv_store is not None else (k, k, k, positions)
    if kv_store is not None:
        check_kv_store(k, v, k_cache, v_cache)
        if slots.shape[0] < num_tokens:
            raise ValueError(f"{slots.shape[0]} slots for {num_tokens} tokens")
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    _launch_rotary(
        (num_tokens,),
        # Without norms the kernel never reads the weight pointers; cos stands in for them.
        (q, k, positions, cos, sin, q_weight, k_weight, v, k_cache, v_cache, slots),
        (float(eps),),
        {
            "STRIDE_Q_TOK": q.stride(0),
            "STRIDE_Q_HEAD": q.stride(1),
            "STRIDE_K_TOK": k.stride(0),
            "STRIDE_K_HEAD": k.stride(1),
            "STRIDE_TABLE": cos.stride(0),
            "NUM_HEADS": num_heads,
            "NUM_KV_HEADS": num_kv_heads,
            "Q_HEADS_PAD": next_power_of_2(num_heads),
            "KV_HEADS_PAD": next_power_of_2(num_kv_heads),
            "HALF": half,
            "HAS_NORM": norm_weights is not None,
            "STRIDE_V_TOK": v.stride(0),
            "STRIDE_V_HEAD": v.stride(1),
            "STORE_KV": kv_store is not None,
            "PDL": _pdl.launches_early(q.device),
        },
    )


@triton.jit
def _rms_normed(x1, x2, weight_ptr, eps, dims, x_dtype, HALF: tl.constexpr):
    """Both halves of each row (head) normalised over the whole head and scaled, rounded to
    ``x_dtype`` after normalising and after scaling, as ``RMSNorm`` does."""
    inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(weight_ptr + dims).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HALF + dims).to(tl.float32)[None, :]
    x1 = (x1 * inv_rms).to(x_dtype).to(tl.float32) * w1
    x2 = (x2 * inv_rms).to(x_dtype).to(tl.float32) * w2
    return x1.to(x_dtype).to(tl.float32), x2.to(x_dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    x_ptr, stride_head, cos, sin, weight_ptr, eps,
    NUM: tl.constexpr, NUM_PAD: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Rotate (after normalising, with ``HAS_NORM``) the ``NUM`` heads at ``x_ptr`` (one
    token) in place; return both rotated halves, rounded as stored."""
    heads = tl.arange(0, NUM_PAD)
    dims = tl.arange(0, HALF)
    mask = (heads < NUM)[:, None]
    first_ptrs = x_ptr + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        x1, x2 = _rms_normed(x1, x2, weight_ptr, eps, dims, x_ptr.dtype.element_ty, HALF)
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty)
    tl.store(first_ptrs, out1, mask=mask)
    tl.store(first_ptrs + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _store_token_kv(
    k1, k2, v_ptr, stride_v_head, k_cache_ptr, v_cache_ptr, slot,
    NUM: tl.constexpr, NUM_PAD: tl.constexpr, HALF: tl.constexpr,
):
    """One token's rotated k (its halves) and its v into cache slot ``slot`` (dense
    ``[slot, head, dim]``); nothing for a negative slot."""
    heads = tl.arange(0, NUM_PAD)
    dims = tl.arange(0, HALF)
    mask = (heads < NUM)[:, None] & (slot >= 0)
    v_ptrs = v_ptr + heads[:, None] * stride_v_head + dims[None, :]
    v1 = tl.load(v_ptrs, mask=mask, other=0.0)
    v2 = tl.load(v_ptrs + HALF, mask=mask, other=0.0)
    offsets = slot * (NUM * 2 * HALF) + heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(k_cache_ptr + offsets, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_cache_ptr + offsets + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + offsets, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + offsets + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, eps,
    STRIDE_Q_TOK: tl.constexpr,
    STRIDE_Q_HEAD: tl.constexpr,
    STRIDE_K_TOK: tl.constexpr,
    STRIDE_K_HEAD: tl.constexpr,
    STRIDE_TABLE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STRIDE_V_TOK: tl.constexpr,
    STRIDE_V_HEAD: tl.constexpr,
    STORE_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + position * STRIDE_TABLE + dims)
    sin = tl.load(sin_ptr + position * STRIDE_TABLE + dims)
    _rotate_heads(
        q_ptr + token * STRIDE_Q_TOK, STRIDE_Q_HEAD, cos, sin, q_weight_ptr, eps,
        NUM_HEADS, Q_HEADS_PAD, HALF, HAS_NORM,
    )
    k1, k2 = _rotate_heads(
        k_ptr + token * STRIDE_K_TOK, STRIDE_K_HEAD, cos, sin, k_weight_ptr, eps,
        NUM_KV_HEADS, KV_HEADS_PAD, HALF, HAS_NORM,
    )
    if STORE_KV:
        _store_token_kv(
            k1, k2, v_ptr + token * STRIDE_V_TOK, STRIDE_V_HEAD, k_cache_ptr, v_cache_ptr,
            tl.load(slots_ptr + token), NUM_KV_HEADS, KV_HEADS_PAD, HALF,
        )


_launch_rotary = CachedLauncher(_rotary_kernel)

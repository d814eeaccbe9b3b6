"""Softmax top-k routing of a mixture-of-experts layer in one launch.

One program per token: the softmax of its router logits in fp32, the `top_k` largest
probabilities picked one at a time (largest first, as `torch.topk` orders them; equal
probabilities go to the lower expert id), optionally rescaled to sum to one. PyTorch takes
five launches for this (softmax, top-k's two kernels, the sum, the division) and one more
to cast the ids; a decode step of a 48-layer MoE paid them every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels._launch import CachedLauncher, next_power_of_2, require_last_dim_contiguous


def route_top_k(router_logits: torch.Tensor, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As `bcg.layers.fused_moe.select_experts`: `[T, E]` logits -> (`[T, top_k]` fp32
    weights, `[T, top_k]` int32 expert ids)."""
    if router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"router_logits must be [tokens, experts] with top_k ({top_k}) in "
                         f"[1, experts]; got {tuple(router_logits.shape)}")
    require_last_dim_contiguous("router_logits", router_logits)
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    _launch_route(
        (num_tokens,),
        (router_logits, weights, ids),
        (),
        {"NUM_EXPERTS": num_experts, "TOP_K": top_k, "RENORMALIZE": renormalize,
         "STRIDE_LOGITS": router_logits.stride(0), "BLOCK_E": next_power_of_2(num_experts),
         "BLOCK_K": next_power_of_2(top_k)},
        # One warp: each top-k pick's two reductions stay in warp shuffles (4 warps sync
        # through shared memory: 3.4 us a layer at one token on the H100).
        num_warps=1,
    )
    return weights, ids


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    STRIDE_LOGITS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + token * STRIDE_LOGITS + experts, mask=valid,
                     other=float("-inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, 0))
    probs = exps / tl.sum(exps, 0)
    # NaNs (a broken router's) rank below every probability, padding lanes and picked experts
    # below everything: each id is distinct and in range whatever the logits.
    remaining = tl.where(valid, tl.where(probs == probs, probs, -1.0), float("-inf"))
    k = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(remaining, 0)
        # The lowest expert id among the largest (a tie keeps the order of the ids).
        best_id = tl.min(tl.where(remaining == best, experts, BLOCK_E), 0)
        picked = tl.where(k == i, best, picked)
        picked_ids = tl.where(k == i, best_id, picked_ids)
        remaining = tl.where(experts == best_id, float("-inf"), remaining)
    if RENORMALIZE:
        picked = picked / tl.sum(picked, 0)
    tl.store(weights_ptr + token * TOP_K + k, picked, mask=k < TOP_K)
    tl.store(ids_ptr + token * TOP_K + k, picked_ids, mask=k < TOP_K)


_launch_route = CachedLauncher(_route_kernel)

"""Softmax top-k routing of a mixture-of-experts layer in one launch.

One program per token: the softmax of its router logits in fp32, the `top_k` largest
probabilities picked one at a time (largest first, as `torch.topk` orders them; equal
probabilities go to the lower expert id), optionally rescaled to sum to one. PyTorch takes
five launches for this (softmax, top-k's two kernels, the sum, the division) and one more
to cast the ids; a decode step of a 48-layer MoE paid them every layer.

Decode-sized steps (`route_hidden_top_k`) take the router's linear layer into the same
launch: programs per token each compute the logits of a few experts, and the last of them
to finish picks the top-k. In a qwen3-30b-a3b decode step at one token on the H100 the
router's GEMM (cuBLAS) and the route kernel took 5.0 + 2.3 us a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._launch import CachedLauncher, next_power_of_2, require_last_dim_contiguous
from bcg.utils import cdiv


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
         "BLOCK_K": next_power_of_2(top_k), "PDL": _pdl.launches_early(device)},
        # One warp: each top-k pick's two reductions stay in warp shuffles (4 warps sync
        # through shared memory: 3.4 us a layer at one token on the H100).
        num_warps=1,
    )
    return weights, ids


# Tokens up to this route from their hidden states in one launch (decode-sized steps, where
# the router's GEMM only streams its small weight); larger steps multiply through cuBLAS.
MAX_FUSED_ROUTER_TOKENS = 16
# Experts whose logits one program computes: 64 programs a token at 128 experts, each
# streaming 8 KiB of a 2048-wide router. One warp streams little at a time, so many small
# programs beat a few large ones (H100, in CUDA graphs, 1 / 8 / 16 tokens of a 128 x 2048
# router: 4.2 / 4.7 / 5.2 us; with 4 experts a program 4.9 / 5.3 / 5.5, with 16 10.8 / 11.2
# / 11.3; cuBLAS then the route kernel 6.7 / 7.1 / 7.2).
EXPERTS_PER_PROGRAM = 2
ROUTER_BLOCK_HIDDEN = 1024  # hidden columns per load


def route_hidden_top_k(hidden_states: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                       renormalize: bool,
                       arrivals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_top_k(hidden_states @ router_weight.T, top_k, renormalize)` in one launch, the
    logits rounded to `hidden_states`' dtype as the router's linear layer would round them.

    Args:
        hidden_states: `[T, H]`, T <= MAX_FUSED_ROUTER_TOKENS, last dim contiguous.
        router_weight: `[E, H]`, last dim contiguous, `hidden_states`' dtype.
        arrivals: int32 `[MAX_FUSED_ROUTER_TOKENS]`, zero between calls (the kernel leaves
            it so): each token's programs done so far. One per caller that may run
            concurrently with another; calls in one stream may share it.
    """
    num_tokens, hidden = hidden_states.shape
    num_experts = router_weight.shape[0]
    if (num_tokens > MAX_FUSED_ROUTER_TOKENS or router_weight.shape[1] != hidden
            or router_weight.dtype != hidden_states.dtype or not 1 <= top_k <= num_experts
            or arrivals.dtype != torch.int32 or arrivals.numel() < num_tokens):
        raise ValueError(
            f"route_hidden_top_k takes at most {MAX_FUSED_ROUTER_TOKENS} tokens [T, H], a "
            f"router [E, H] of their dtype, top_k in [1, E] and int32 arrivals for each "
            f"token; got {tuple(hidden_states.shape)} {hidden_states.dtype}, "
            f"{tuple(router_weight.shape)} {router_weight.dtype}, top_k {top_k}, arrivals "
            f"{tuple(arrivals.shape)} {arrivals.dtype}")
    require_last_dim_contiguous("hidden_states", hidden_states)
    require_last_dim_contiguous("router_weight", router_weight)
    device = hidden_states.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=device)
    _launch_router_route(
        (num_tokens, cdiv(num_experts, EXPERTS_PER_PROGRAM)),
        (hidden_states, router_weight, logits, arrivals, weights, ids),
        (),
        {"HIDDEN": hidden, "NUM_EXPERTS": num_experts, "TOP_K": top_k,
         "RENORMALIZE": renormalize, "STRIDE_X": hidden_states.stride(0),
         "STRIDE_W": router_weight.stride(0), "EXPERTS_PER_PROGRAM": EXPERTS_PER_PROGRAM,
         "BLOCK_HIDDEN": ROUTER_BLOCK_HIDDEN, "BLOCK_E": next_power_of_2(num_experts),
         "BLOCK_K": next_power_of_2(top_k), "PDL": _pdl.launches_early(device)},
        num_warps=1,  # as the route kernel: the last program's picks in warp shuffles
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
    PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * STRIDE_LOGITS + experts, mask=experts < NUM_EXPERTS,
                     other=float("-inf")).to(tl.float32)
    _store_top_k(logits, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, NUM_EXPERTS,
                 TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)


@triton.jit
def _store_top_k(logits, weights_ptr, ids_ptr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                 RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store the `TOP_K` largest softmax probabilities of the fp32 `[BLOCK_E]` `logits`
    (lanes past `NUM_EXPERTS` ignored) and their expert ids."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < NUM_EXPERTS
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
    tl.store(weights_ptr + k, picked, mask=k < TOP_K)
    tl.store(ids_ptr + k, picked_ids, mask=k < TOP_K)


_launch_route = CachedLauncher(_route_kernel)


@triton.jit
def _router_route_kernel(
    x_ptr, w_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr,
    HIDDEN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_W: tl.constexpr,
    EXPERTS_PER_PROGRAM: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * EXPERTS_PER_PROGRAM + tl.arange(0, EXPERTS_PER_PROGRAM)
    valid = experts < NUM_EXPERTS
    acc = tl.zeros([EXPERTS_PER_PROGRAM], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK_HIDDEN):
        cols = start + tl.arange(0, BLOCK_HIDDEN)
        in_row = cols < HIDDEN
        x = tl.load(x_ptr + token * STRIDE_X + cols, mask=in_row, other=0.0)
        w = tl.load(w_ptr + experts[:, None] * STRIDE_W + cols[None, :],
                    mask=valid[:, None] & in_row[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    row_logits_ptr = logits_ptr + token * NUM_EXPERTS
    tl.store(row_logits_ptr + experts, logits, mask=valid)
    # Release these logits, then count this program in; the last one in picks the top-k
    # (decode attention's merge does the same).
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel")
    if arrived == tl.num_programs(1) - 1:
        tl.debug_barrier()
        every_expert = tl.arange(0, BLOCK_E)
        # Past the L1 cache, which the other programs' stores do not reach.
        row = tl.load(row_logits_ptr + every_expert, mask=every_expert < NUM_EXPERTS,
                      other=float("-inf"), cache_modifier=".cg")
        _store_top_k(row, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, NUM_EXPERTS,
                     TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
        tl.store(arrivals_ptr + token, 0)  # ready for the next call


_launch_router_route = CachedLauncher(_router_route_kernel)

"""The one-launch softmax top-k routing against PyTorch's (`select_experts` on the CPU).

Without a GPU the kernel runs in Triton's interpreter on fp32 logits; on a GPU on bf16
logits, as a router's linear gives them. Equal probabilities may be picked in either order
by PyTorch, so the ids are compared through the probabilities they pick."""

from __future__ import annotations

import pytest
import torch

from bcg.layers.fused_moe import select_experts
from tests.kernels_support import DEVICE, DTYPE, ON_GPU, import_kernels

moe_routing = import_kernels("moe_routing")

# (tokens, experts, top-k): Qwen3-30B-A3B's 128 / 8, a non-power-of-two expert count and
# top-k, one expert per token.
SHAPES = [(1, 128, 8), (13, 60, 6), (7, 8, 2), (5, 16, 1)] + ([(512, 128, 8)] if ON_GPU else [])


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_routing_matches_select_experts(shape: tuple, renormalize: bool) -> None:
    num_tokens, num_experts, top_k = shape
    generator = torch.Generator().manual_seed(num_experts + top_k)
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(DEVICE, DTYPE)
    weights, ids = moe_routing.route_top_k(logits, top_k, renormalize)
    expected_weights, expected_ids = select_experts(logits.cpu().float(), top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    ids, weights = ids.cpu().long(), weights.cpu()
    assert all(len(set(row.tolist())) == top_k for row in ids), "an expert picked twice"
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, expected_ids.long()))
    torch.testing.assert_close(weights, expected_weights)


def test_routing_rejects_more_choices_than_experts() -> None:
    with pytest.raises(ValueError, match="top_k"):
        moe_routing.route_top_k(torch.zeros(2, 4, device=DEVICE), 5, True)


def test_no_tokens_route_nowhere() -> None:
    weights, ids = moe_routing.route_top_k(torch.zeros(0, 8, device=DEVICE), 2, True)
    assert weights.shape == ids.shape == (0, 2)


def test_a_nan_logit_still_routes_to_distinct_experts_in_range() -> None:
    """A broken router must not send the grouped GEMMs out of bounds."""
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE, DTYPE)
    logits[1, 5] = float("nan")
    _, ids = moe_routing.route_top_k(logits, 4, True)
    assert ids.min() >= 0 and ids.max() < 16
    assert all(len(set(row.tolist())) == 4 for row in ids.cpu())


# (tokens, experts, hidden, top-k): 30B-A3B's router at one token (hidden cut for the
# interpreter), the most tokens the fused router takes with experts and hidden that fill no
# whole tile, a few experts.
ROUTER_SHAPES = [(1, 128, 512, 8), (16, 60, 300, 6), (3, 8, 64, 2)]


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw"])
@pytest.mark.parametrize("shape", ROUTER_SHAPES, ids=str)
def test_the_fused_router_routes_as_the_router_then_route(shape: tuple,
                                                          renormalize: bool) -> None:
    num_tokens, num_experts, hidden, top_k = shape
    generator = torch.Generator().manual_seed(num_experts + hidden)
    x = torch.randn(num_tokens, hidden, generator=generator).to(DEVICE, DTYPE)
    router = (torch.randn(num_experts, hidden, generator=generator) * hidden**-0.5).to(
        DEVICE, DTYPE)
    arrivals = torch.zeros(moe_routing.MAX_FUSED_ROUTER_TOKENS, dtype=torch.int32,
                           device=DEVICE)
    for _ in range(2):  # the second call finds the arrivals the first left at zero
        weights, ids = moe_routing.route_hidden_top_k(x, router, top_k, renormalize, arrivals)
    logits = torch.nn.functional.linear(x, router)
    expected_weights, expected_ids = select_experts(logits.cpu().float(), top_k, renormalize)
    assert not arrivals.any()
    ids, weights = ids.cpu().long(), weights.cpu()
    assert all(len(set(row.tolist())) == top_k for row in ids), "an expert picked twice"
    # Summed in another order than cuBLAS: in bf16 a logit may round one step apart.
    tolerance = {} if DTYPE == torch.float32 else {"atol": 2e-3, "rtol": 2e-2}
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, expected_ids.long()),
                               **tolerance)
    torch.testing.assert_close(weights, expected_weights, **tolerance)


def test_the_fused_router_refuses_more_tokens_than_it_takes() -> None:
    too_many = moe_routing.MAX_FUSED_ROUTER_TOKENS + 1
    arrivals = torch.zeros(too_many, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        moe_routing.route_hidden_top_k(torch.zeros(too_many, 8, device=DEVICE, dtype=DTYPE),
                                       torch.zeros(4, 8, device=DEVICE, dtype=DTYPE), 2, True,
                                       arrivals)

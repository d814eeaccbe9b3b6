"""Expert parallel by all-to-all, on two gloo ranks (CPU, fp32): both exchanges, in blocks
of a fixed size and in counted sizes, give every rank the unsplit experts' output, for
skewed routing (every choice on one rank), top-1 and top-2, a last slice shorter than the
others, an empty slice, and graph padding rows; the step's size picks the exchange, and
traced code (torch.compile) takes the counted one whatever its size."""

from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from bcg.distributed.expert_parallel import set_expert_parallel
from bcg.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    spawned_group_store,
)
from bcg.forward import set_forward_context
from bcg.layers import moe_alltoall
from bcg.layers.fused_moe import FusedMoE, select_experts
from bcg.layers.moe_ref import fused_experts_ref
from bcg.layers.step_op import prepare_for_compile
from bcg.utils import free_port
from tests.numerics import relative_error

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 16, 12, 2
# Steps up to this size exchange fixed blocks (the engine's alltoall_fixed_block_tokens).
FIXED_BLOCK_TOKENS = 6
TOLERANCE = 1e-5


def routing(num_tokens: int, skewed: bool, top_k: int = TOP_K
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of 8 experts; skewed: every choice among rank 0's experts 0-3."""
    logits = torch.randn(num_tokens, EXPERTS)
    if skewed:
        logits[:, EXPERTS // 2 :] -= 100.0
    return select_experts(logits, top_k, renormalize=True)


def rank_layer(gate_up: torch.Tensor, down: torch.Tensor) -> FusedMoE:
    layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE)
    mine = slice(layer.first_expert, layer.first_expert + layer.local_experts)
    layer.gate_up_proj.data.copy_(gate_up[mine])
    layer.down_proj.data.copy_(down[mine])
    return layer


def both_exchanges(layer: FusedMoE, hidden: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, real_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    fixed, counted = torch.empty_like(hidden), torch.empty_like(hidden)
    moe_alltoall._exchange_fixed_blocks(layer, hidden, weights, ids, fixed)
    with set_forward_context(SimpleNamespace(batch=SimpleNamespace(num_tokens=real_tokens))):
        moe_alltoall._exchange_counted(layer, hidden, weights, ids, counted)
    return fixed, counted


def check_exchanges(layer: FusedMoE, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    # (rows, real tokens among them, skewed, top_k): 7 rows leave rank 1 three; 1 row none
    for rows, real, skewed, top_k in [(7, 7, False, 2), (7, 7, True, 2), (1, 1, True, 2),
                                      (8, 5, False, 2), (5, 5, False, 1)]:
        hidden = torch.randn(rows, HIDDEN)
        weights, ids = routing(rows, skewed, top_k)
        expected = fused_experts_ref(hidden, gate_up, down, weights, ids)
        fixed, counted = both_exchanges(layer, hidden, weights, ids, real)
        where = f"{rows} rows ({real} real), skewed={skewed}, top-{top_k}"
        assert relative_error(fixed, expected) <= TOLERANCE, where
        assert relative_error(counted[:real], expected[:real]) <= TOLERANCE, where


def check_the_size_picks_the_exchange(layer: FusedMoE, limit: int) -> None:
    taken = []
    fixed, counted = moe_alltoall._exchange_fixed_blocks, moe_alltoall.exchange_counted
    moe_alltoall._exchange_fixed_blocks = lambda *args: (taken.append("fixed"), fixed(*args))
    moe_alltoall.exchange_counted = lambda *args: (taken.append("counted"), counted(*args))
    try:
        for rows in (limit, limit + 1):
            hidden = torch.randn(rows, HIDDEN)
            weights, ids = routing(rows, skewed=False)
            with set_forward_context(SimpleNamespace(batch=SimpleNamespace(num_tokens=rows))):
                moe_alltoall.alltoall_experts(layer, hidden, weights, ids)
    finally:
        moe_alltoall._exchange_fixed_blocks, moe_alltoall.exchange_counted = fixed, counted
    assert taken == ["fixed", "counted"]


def check_traced_steps_take_the_counted_exchange(layer: FusedMoE, gate_up: torch.Tensor,
                                                  down: torch.Tensor) -> None:
    def refuse(*args) -> None:
        raise AssertionError("traced code took the fixed-size exchange")

    fixed, moe_alltoall._exchange_fixed_blocks = moe_alltoall._exchange_fixed_blocks, refuse
    try:
        hidden = torch.randn(3, HIDDEN)  # within the fixed exchange's size
        weights, ids = routing(3, skewed=False)
        prepare_for_compile()
        compiled = torch.compile(moe_alltoall.alltoall_experts, backend="eager", fullgraph=False)
        with set_forward_context(SimpleNamespace(batch=SimpleNamespace(num_tokens=3))):
            out = compiled(layer, hidden, weights, ids)
    finally:
        moe_alltoall._exchange_fixed_blocks = fixed
        torch.compiler.reset()
    expected = fused_experts_ref(hidden, gate_up, down, weights, ids)
    assert relative_error(out, expected) <= TOLERANCE


def rank_main(rank: int, port: int) -> None:
    init_tensor_parallel(2, "gloo", spawned_group_store(2, rank, port), rank)
    set_expert_parallel(True, "alltoall", FIXED_BLOCK_TOKENS)
    try:
        torch.manual_seed(0)  # the same weights and tokens on both ranks
        gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.2
        down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.2
        layer = rank_layer(gate_up, down)
        check_exchanges(layer, gate_up, down)
        check_the_size_picks_the_exchange(layer, FIXED_BLOCK_TOKENS)
        check_traced_steps_take_the_counted_exchange(layer, gate_up, down)
    finally:
        set_expert_parallel(False)
        destroy_tensor_parallel()


def test_both_exchanges_give_the_unsplit_experts_output_on_every_rank():
    mp.spawn(rank_main, args=(free_port(),), nprocs=2, join=True)

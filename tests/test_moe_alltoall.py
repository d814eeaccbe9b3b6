"""Expert parallel by all-to-all, on two gloo ranks (CPU, fp32): both exchanges, in blocks
of a fixed size and in counted sizes, give every rank the unsplit experts' output, for
skewed routing (every choice on one rank), a last slice shorter than the others, an empty
slice, and graph padding rows; and the step's size picks the exchange."""

from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from bcg.distributed.expert_parallel import set_expert_parallel
from bcg.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from bcg.forward import set_forward_context
from bcg.layers import moe_alltoall
from bcg.layers.fused_moe import FusedMoE, select_experts
from bcg.layers.moe_ref import fused_experts_ref
from bcg.utils import free_port
from tests.numerics import relative_error

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 16, 12, 2
FIXED_BLOCK_TOKENS = 6  # steps up to this size exchange fixed blocks (the engine's max_num_seqs)
TOLERANCE = 1e-5


def routing(num_tokens: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 of 8 experts; skewed: every token's two choices among rank 0's experts 0-3."""
    logits = torch.randn(num_tokens, EXPERTS)
    if skewed:
        logits[:, EXPERTS // 2 :] -= 100.0
    return select_experts(logits, TOP_K, renormalize=True)


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
    # (rows, real tokens among them, skewed): 7 rows leave rank 1 three; 1 row leaves it none
    for rows, real, skewed in [(7, 7, False), (7, 7, True), (1, 1, True), (8, 5, False)]:
        hidden = torch.randn(rows, HIDDEN)
        weights, ids = routing(rows, skewed)
        expected = fused_experts_ref(hidden, gate_up, down, weights, ids)
        fixed, counted = both_exchanges(layer, hidden, weights, ids, real)
        where = f"{rows} rows ({real} real), skewed={skewed}"
        assert relative_error(fixed, expected) <= TOLERANCE, where
        assert relative_error(counted[:real], expected[:real]) <= TOLERANCE, where


def check_the_size_picks_the_exchange(layer: FusedMoE, limit: int) -> None:
    counted = []
    exchange = moe_alltoall.exchange_counted
    moe_alltoall.exchange_counted = lambda *args: (counted.append(True), exchange(*args))
    try:
        for rows in (limit, limit + 1):
            hidden = torch.randn(rows, HIDDEN)
            weights, ids = routing(rows, skewed=False)
            with set_forward_context(SimpleNamespace(batch=SimpleNamespace(num_tokens=rows))):
                moe_alltoall.alltoall_experts(layer, hidden, weights, ids)
    finally:
        moe_alltoall.exchange_counted = exchange
    assert counted == [True], "only the step over the limit takes the counted exchange"


def rank_main(rank: int, port: int) -> None:
    init_tensor_parallel(2, "gloo", f"tcp://127.0.0.1:{port}", rank)
    set_expert_parallel(True, "alltoall", FIXED_BLOCK_TOKENS)
    try:
        torch.manual_seed(0)  # the same weights and tokens on both ranks
        gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.2
        down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.2
        layer = rank_layer(gate_up, down)
        check_exchanges(layer, gate_up, down)
        check_the_size_picks_the_exchange(layer, FIXED_BLOCK_TOKENS)
    finally:
        set_expert_parallel(False)
        destroy_tensor_parallel()


def test_both_exchanges_give_the_unsplit_experts_output_on_every_rank():
    mp.spawn(rank_main, args=(free_port(),), nprocs=2, join=True)

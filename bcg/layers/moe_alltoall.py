"""Expert parallel with all-to-all dispatch: each token goes only to the ranks holding its
experts, instead of every rank computing its experts' part of every token.

Every rank holds every token (attention is tensor parallel), so each rank takes an equal
slice of the step's real tokens, sends each of their choices to the rank holding its expert
(`all_to_all_single`, with per-rank row counts the host must know), runs the rows it
receives through its experts, sends the results back, weights and sums each token's choices,
and all-gathers the slices. The counts need a host sync, so the exchange is one `step_op`:
a graph break in breakable graphs, outside the compiled region under torch.compile. A full
decode graph cannot hold it (`EngineConfig` refuses that pairing). Only the real rows are
exchanged: graph padding rows may differ between ranks, and so would their routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bcg.forward import get_forward_context
from bcg.layers.step_op import step_op
from bcg.utils import cdiv

if TYPE_CHECKING:
    from bcg.layers.fused_moe import FusedMoE


def alltoall_experts(layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """`[T, H]` tokens (the same on every rank), their routing over global expert ids ->
    `[T, H]` expert outputs on every rank (rows past the step's real tokens unset)."""
    out = torch.empty_like(hidden_states)
    exchange(layer, hidden_states, topk_weights, topk_ids, out)
    return out


def _exchange(layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, out: torch.Tensor) -> None:
    tp = layer.tp
    num_tokens = get_forward_context().batch.num_tokens
    per_rank = cdiv(num_tokens, tp.size)
    start = min(tp.rank * per_rank, num_tokens)
    stop = min(start + per_rank, num_tokens)
    top_k = topk_ids.shape[1]
    choices = topk_ids[start:stop].flatten().long()
    owner = torch.div(choices, layer.local_experts, rounding_mode="floor")
    order = torch.sort(owner, stable=True).indices  # choices grouped by destination rank
    send_counts = torch.bincount(owner, minlength=tp.size)
    recv_counts = tp.all_to_all(send_counts, [1] * tp.size, [1] * tp.size)
    sends, receives = send_counts.tolist(), recv_counts.tolist()

    rows = tp.all_to_all(hidden_states[start:stop][order // top_k], sends, receives)
    experts = tp.all_to_all((choices[order] % layer.local_experts).to(torch.int32), sends,
                            receives)
    ones = torch.ones(len(experts), 1, dtype=torch.float32, device=rows.device)
    results = tp.all_to_all(layer.compute(rows, ones, experts[:, None]), receives, sends)

    per_choice = torch.empty_like(results)
    per_choice[order] = results
    weighted = per_choice.float().view(-1, top_k, per_choice.shape[1]) * topk_weights[
        start:stop, :, None]
    mine = out.new_zeros(per_rank, out.shape[1])
    mine[: stop - start] = weighted.sum(dim=1)
    out[:num_tokens] = tp.all_gather_rows(mine)[:num_tokens]


exchange = step_op(_exchange)

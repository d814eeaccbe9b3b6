"""Expert parallel with all-to-all dispatch: each token goes only to the ranks holding its
experts, instead of every rank computing its experts' part of every token.

Every rank holds every token (attention is tensor parallel), so each rank takes an equal
slice of the step's tokens, sends each of their choices to the rank holding its expert
(`all_to_all_single`), runs the rows it receives through its experts, sends the results
back, weights and sums each token's choices, and all-gathers the slices. Two forms, picked
by the step's size alone, so every rank picks the same (SGLang's DeepEP 'auto' mode):
- steps of at most `fixed_block_tokens` tokens (the engine's
  `EngineConfig.alltoall_fixed_block_tokens`: by default max(max_num_seqs, 2048), so every
  decode step and every prefill chunk of the default size) exchange blocks of a fixed
  size, room for every choice of a rank's slice on one rank, the unused rows marked with
  expert -1: no count reaches the host, so the exchange runs inside any CUDA graph
  (DeepEP's low-latency mode). That costs top_k times the slice's bytes to each rank (at
  256 tokens, top-8 and hidden 4096, 16 MiB a rank per exchange), less than a host sync
  per layer up to about two thousand tokens (`bcg.config.ALLTOALL_FIXED_BLOCK_TOKENS` has
  the measurements);
- larger ones send exactly their choices, in row counts per rank that the host must know
  (a sync): one `step_op`, a graph break in breakable graphs, outside the compiled region
  under torch.compile. Only the real rows are exchanged: graph padding rows may differ
  between ranks, and so would their routing.
Traced code (`torch.compile`, piecewise graphs) always takes the second form, whatever its
size, so its collectives stay eager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bcg.distributed.parallel_state import TensorParallel
from bcg.forward import get_forward_context
from bcg.graph import is_in_breakable_cuda_graph
from bcg.layers.step_op import step_op
from bcg.utils import cdiv

if TYPE_CHECKING:
    from bcg.layers.fused_moe import FusedMoE


def alltoall_experts(layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """`[T, H]` tokens (the same on every rank), their routing over global expert ids ->
    `[T, H]` expert outputs on every rank (rows past the step's real tokens unset)."""
    out = torch.empty_like(hidden_states)
    # is_compiling first: a size test under torch.compile would guard on the token count
    # and recompile the stack for steps on either side of it.
    if (not torch.compiler.is_compiling()
            and hidden_states.shape[0] <= layer.fixed_block_tokens):
        _exchange_fixed_blocks(layer, hidden_states, topk_weights, topk_ids, out)
        return out
    assert not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
                and not is_in_breakable_cuda_graph()), (
        f"a full CUDA graph of {hidden_states.shape[0]} tokens, more than the "
        f"{layer.fixed_block_tokens} the fixed-size exchange takes (decode graphs stay within)")
    exchange_counted(layer, hidden_states, topk_weights, topk_ids, out)
    return out


def _exchange_fixed_blocks(layer: FusedMoE, hidden_states: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          out: torch.Tensor) -> None:
    """Every row of `hidden_states` (graph padding included: its results are dropped),
    through blocks of `slice rows * top_k` rows per rank; shapes depend on `T` alone."""
    tp = layer.tp
    num_rows = hidden_states.shape[0]
    per_rank = cdiv(num_rows, tp.size)
    start, stop = _slice(tp.rank, per_rank, num_rows)
    top_k = topk_ids.shape[1]
    capacity = per_rank * top_k
    choices = topk_ids[start:stop].flatten().long()
    owner = torch.div(choices, layer.local_experts, rounding_mode="floor")
    # each choice's row in its owner's block: how many choices before it go to that owner
    ranks = torch.arange(tp.size, device=choices.device)
    slot = (owner[:, None] == ranks).cumsum(0).gather(1, owner[:, None]).squeeze(1) - 1
    rows = owner * capacity + slot

    sent = hidden_states.new_empty(tp.size * capacity, hidden_states.shape[1])
    tokens = hidden_states[start:stop]
    sent[rows] = tokens[:, None].expand(-1, top_k, -1).reshape(-1, tokens.shape[1])
    experts = torch.full((tp.size * capacity,), -1, dtype=torch.int32, device=choices.device)
    experts[rows] = (choices % layer.local_experts).to(torch.int32)
    blocks = [capacity] * tp.size
    received = tp.all_to_all(sent, blocks, blocks)
    received_experts = tp.all_to_all(experts, blocks, blocks)
    ones = torch.ones(len(received), 1, dtype=torch.float32, device=received.device)
    results = tp.all_to_all(layer.compute(received, ones, received_experts[:, None]),
                            blocks, blocks)
    out.copy_(_combine(tp, results[rows], topk_weights[start:stop], per_rank)[:num_rows])


def _exchange_counted(layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, out: torch.Tensor) -> None:
    tp = layer.tp
    num_tokens = get_forward_context().batch.num_tokens
    per_rank = cdiv(num_tokens, tp.size)
    start, stop = _slice(tp.rank, per_rank, num_tokens)
    top_k = topk_ids.shape[1]
    choices = topk_ids[start:stop].flatten().long()
    owner = torch.div(choices, layer.local_experts, rounding_mode="floor")
    order = torch.sort(owner, stable=True).indices  # choices grouped by destination rank
    # Counted without torch.bincount, which reads its largest value on the host, and both
    # counts read in one go: a single host sync a layer.
    ranks = torch.arange(tp.size, device=owner.device)
    send_counts = (owner[:, None] == ranks).sum(dim=0)
    recv_counts = tp.all_to_all(send_counts, [1] * tp.size, [1] * tp.size)
    sends, receives = torch.stack([send_counts, recv_counts]).tolist()

    rows = tp.all_to_all(hidden_states[start:stop][order // top_k], sends, receives)
    experts = tp.all_to_all((choices[order] % layer.local_experts).to(torch.int32), sends,
                            receives)
    ones = torch.ones(len(experts), 1, dtype=torch.float32, device=rows.device)
    results = tp.all_to_all(layer.compute(rows, ones, experts[:, None]), receives, sends)

    per_choice = torch.empty_like(results)
    per_choice[order] = results
    gathered = _combine(tp, per_choice, topk_weights[start:stop], per_rank)
    out[:num_tokens] = gathered[:num_tokens]


exchange_counted = step_op(_exchange_counted)


def _slice(rank: int, per_rank: int, num_rows: int) -> tuple[int, int]:
    """This rank's rows of the step: `per_rank` of them, fewer (or none) on the last ranks."""
    start = min(rank * per_rank, num_rows)
    return start, min(start + per_rank, num_rows)


def _combine(tp: TensorParallel, per_choice: torch.Tensor, weights: torch.Tensor,
             per_rank: int) -> torch.Tensor:
    """The slice's expert results (`[n * K, H]`, its choices in order) weighted and summed
    per token, then every rank's slice gathered: `[per_rank * ranks, H]`."""
    top_k = weights.shape[1]
    weighted = per_choice.float().view(-1, top_k, per_choice.shape[1]) * weights[:, :, None]
    mine = per_choice.new_zeros(per_rank, per_choice.shape[1])
    mine[: len(weighted)] = weighted.sum(dim=1)
    return tp.all_gather_rows(mine)

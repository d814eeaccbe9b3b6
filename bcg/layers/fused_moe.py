"""The experts of a mixture-of-experts layer, stacked, split across the ranks.

All experts of a layer live in two stacked weights, `gate_up_proj` `[E, 2 * I, H]` and
`down_proj` `[E, H, I]` (checkpoints hold one tensor per expert and projection: they are
stacked as they load). Over tensor-parallel ranks, either each rank holds every expert with
its share of the intermediate dimension (tensor parallel), or a share of the experts whole
(expert parallel, `bcg.distributed.expert_parallel`). The tokens are the same on every
rank; one all-reduce sums the ranks' parts, or under expert parallel with all-to-all
dispatch, tokens travel to their experts' ranks and back (`bcg.layers.moe_alltoall`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bcg.distributed.expert_parallel import expert_parallel
from bcg.distributed.parallel_state import tensor_parallel
from bcg.layers import triton_ops
from bcg.layers.linear import copy_checked
from bcg.layers.moe_alltoall import alltoall_experts
from bcg.layers.moe_ref import fused_experts_ref
from bcg.layers.norm import RMSNorm

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: the `top_k` most probable experts of each token and their
    probabilities (fp32), rescaled to sum to one if `renormalize` (`norm_topk_prob`)."""
    if triton_ops.use_fused_kernels(router_logits):
        return triton_ops.route_top_k(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated MLPs; each token runs through the ones it was routed to."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        self.num_experts = num_experts
        placement = expert_parallel()
        self.alltoall = placement.enabled and placement.dispatch == "alltoall" and self.tp.size > 1
        self.fixed_block_tokens = placement.fixed_block_tokens
        if placement.enabled:
            self.first_expert, local_experts = self.tp.shard(num_experts, "num_experts")
            self.intermediate_start, local_intermediate = 0, intermediate_size
        else:
            self.first_expert, local_experts = 0, num_experts
            self.intermediate_start, local_intermediate = self.tp.shard(
                intermediate_size, "moe_intermediate_size")
        self.local_experts = local_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(local_experts, 2 * local_intermediate, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(local_experts, hidden_size, local_intermediate), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """`[T, H]` tokens, their `[T, K]` routing weights and global expert ids -> `[T, H]`,
        the same on every rank."""
        if self.alltoall:
            return alltoall_experts(self, hidden_states, topk_weights, topk_ids)
        return self.tp.all_reduce(self.rank_part(hidden_states, topk_weights, topk_ids))

    def add_and_norm(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm.add_and_norm(self(...), residual)`; the ranks' sum, if any, left to the
        norm, which runs the all-reduce, the add and the norm as one kernel where it can. On
        one rank, with the kernels, the norm's launch also sums each token's choices."""
        if self.alltoall:
            return norm.add_and_norm(self(hidden_states, topk_weights, topk_ids), residual)
        if self.tp.size == 1 and triton_ops.use_fused_kernels(hidden_states):
            # One launch a layer fewer: a decode step at batch 1 of qwen3-30b-a3b 3.548 ->
            # 3.511 ms on an H100 (bench/results/s42/callG).
            choices = triton_ops.fused_expert_choices(hidden_states, self.gate_up_proj,
                                                      self.down_proj, topk_weights, topk_ids)
            return triton_ops.sum_add_rms_norm(choices, residual, norm.weight, norm.eps)
        return norm.add_and_norm(self.rank_part(hidden_states, topk_weights, topk_ids),
                                 residual, self.tp)

    def rank_part(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output's sum over the ranks (not under all-to-all)."""
        if self.local_experts != self.num_experts:
            topk_ids = self.local_expert_ids(topk_ids)
        return self.compute(hidden_states, topk_weights, topk_ids)

    def compute(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on `hidden_states`, routed by local expert ids (-1: skip)."""
        if triton_ops.uses_moe_kernel(hidden_states):
            return triton_ops.fused_experts(hidden_states, self.gate_up_proj, self.down_proj,
                                            topk_weights, topk_ids)
        return fused_experts_ref(hidden_states, self.gate_up_proj, self.down_proj,
                                 topk_weights, topk_ids)

    def local_expert_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices, -1 for experts held by other ranks."""
        local = topk_ids - self.first_expert
        elsewhere = (local < 0) | (local >= self.local_experts)
        return local.masked_fill(elsewhere, -1)

    def expert_weight_keys(self, prefix: str) -> set[tuple[str, None]]:
        """The checkpoint names this rank loads: each projection of each of its experts."""
        return {(f"{prefix}.{expert}.{projection}.weight", None)
                for expert in range(self.first_expert, self.first_expert + self.local_experts)
                for projection in EXPERT_PROJECTIONS}

    def fill_dummy(self, name: str, draw: Callable[..., torch.Tensor]) -> None:
        """Random experts (`draw(shape, part)`) as a checkpoint holds them, one tensor per
        expert and projection, this rank's part kept: every split gets the same model."""
        hidden, full = self.gate_up_proj.shape[2], self.intermediate_size
        projections = ["down_proj"] if name.endswith("down_proj") else ["gate_proj", "up_proj"]
        for expert in range(self.first_expert, self.first_expert + self.local_experts):
            for projection in projections:
                shape = (hidden, full) if projection == "down_proj" else (full, hidden)
                part = expert * len(EXPERT_PROJECTIONS) + EXPERT_PROJECTIONS.index(projection)
                self.load_expert_weight(name, draw(shape, part), expert, projection)

    def load_expert_weight(self, name: str, loaded: torch.Tensor, expert: int,
                           projection: str) -> None:
        """Copy this rank's part of one expert's `gate_proj`, `up_proj` (`[I, H]`) or
        `down_proj` (`[H, I]`); experts held by other ranks are skipped."""
        local = expert - self.first_expert
        if not 0 <= local < self.local_experts:
            return
        size, full = self.down_proj.shape[2], self.intermediate_size
        if projection == "down_proj":
            if loaded.dim() == 2 and loaded.shape[1] == full:
                loaded = loaded.narrow(1, self.intermediate_start, size)
            copy_checked(name, self.down_proj.data[local], loaded)
            return
        if loaded.dim() == 2 and loaded.shape[0] == full:
            loaded = loaded.narrow(0, self.intermediate_start, size)
        rows = slice(0, size) if projection == "gate_proj" else slice(size, 2 * size)
        copy_checked(name, self.gate_up_proj.data[local, rows], loaded)

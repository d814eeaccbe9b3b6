"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 whose MLPs are mixtures of experts.

A layer is sparse unless listed in `mlp_only_layers` (or skipped by `decoder_sparse_step`),
whose layers keep the dense MLP. A sparse MLP routes each token to its `num_experts_per_tok`
most probable experts (softmax router) and sums their outputs weighted by those
probabilities, renormalised to one if `norm_topk_prob`. There is no shared expert.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from bcg.layers import triton_ops
from bcg.layers.fused_moe import FusedMoE, select_experts
from bcg.layers.linear import ColumnParallelLinear
from bcg.layers.norm import RMSNorm
from bcg.models.config import ModelConfig
from bcg.models.qwen3 import Qwen3ForCausalLM

# A checkpoint's per-expert tensor: (experts module, expert index, projection).
_EXPERT_WEIGHT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        # The router is replicated: every rank routes every token the same way.
        self.gate = ColumnParallelLinear(config.hidden_size, [config.num_experts], parts=[1])
        self.experts = FusedMoE(config.num_experts, config.hidden_size,
                                config.moe_intermediate_size)
        # Each token's programs of the one-launch router count in here (zero between calls).
        self.register_buffer("route_arrivals", torch.zeros(
            triton_ops.MAX_FUSED_ROUTER_TOKENS, dtype=torch.int32), persistent=False)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' output added to `residual`, then normalised by `norm`: `(normed,
        residual)`."""
        return self.experts.add_and_norm(hidden_states, *self.route(hidden_states), residual,
                                         norm)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and expert ids."""
        router = self.gate.weight
        if triton_ops.uses_fused_router(hidden_states, router):
            return triton_ops.route_hidden_top_k(hidden_states, router, self.top_k,
                                                 self.renormalize, self.route_arrivals)
        return select_experts(self.gate(hidden_states), self.top_k, self.renormalize)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        if config.is_sparse_layer(layer_id):
            return Qwen3MoeSparseMoeBlock(config)
        return super().build_mlp(config, layer_id)

    def _load_one(self, name: str, tensor: torch.Tensor, modules: dict, params: dict):
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match is None:
            return super()._load_one(name, tensor, modules, params)
        experts, expert, projection = match.groups()
        if experts not in modules:
            raise ValueError(f"unexpected weight {name!r}: {experts} is not a sparse layer's "
                             "experts (do mlp_only_layers and decoder_sparse_step match the "
                             "checkpoint?)")
        if int(expert) >= modules[experts].num_experts:
            raise ValueError(f"unexpected weight {name!r}: the config has "
                             f"{modules[experts].num_experts} experts")
        modules[experts].load_expert_weight(name, tensor, int(expert), projection)
        return (name, None)

    def _expected_weight_keys(self, modules: dict, params: dict) -> set:
        """The stacked expert weights are expected as the per-expert tensors they load from."""
        keys = super()._expected_weight_keys(modules, params)
        for path, module in modules.items():
            if isinstance(module, FusedMoE):
                keys -= {(f"{path}.gate_up_proj", None), (f"{path}.down_proj", None)}
                keys |= module.expert_weight_keys(path)
        return keys

"""NemotronH: a Mamba2 hybrid. `hybrid_override_pattern` lays out its blocks, one per
character: `M` a Mamba2 mixer, `*` attention (no positional encoding), `-` an MLP with
squared ReLU; each block is a pre-norm and a residual around its mixer.

Attention layers take consecutive KV cache layers and Mamba layers consecutive state cache
layers, so neither cache holds anything for the other kinds of block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from bcg.layers.embedding import Embedding, LMHead
from bcg.layers.linear import ColumnParallelLinear, RowParallelLinear
from bcg.layers.mamba_mixer import MambaMixer2
from bcg.layers.norm import RMSNorm
from bcg.models.base import CausalLM, run_residual_stack
from bcg.models.config import ATTENTION, MAMBA, ModelConfig
from bcg.models.llama import QKV_PACKED, LlamaAttention


class NemotronHMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(config.hidden_size, [config.intermediate_size],
                                            bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output added to `residual`, then normalised by `norm`: `(normed,
        residual)`."""
        activated = self.up_proj(x, activation="relu_squared")
        return self.down_proj.add_and_norm(activated, residual, norm)


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, cache_index: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == MAMBA:
            self.mixer = MambaMixer2(config.hidden_size, config.mamba, config.rms_norm_eps,
                                     cache_index)
        elif kind == ATTENTION:
            self.mixer = LlamaAttention(config, cache_index, rotary=None,
                                        qkv_bias=config.attention_bias, qk_norm=False)
        else:
            self.mixer = NemotronHMLP(config)

    @property
    def input_layernorm(self) -> RMSNorm:
        """The block's pre-norm, by the name `run_residual_stack` reads."""
        return self.norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states` normed by `norm` -> the next norm's input and the residual
        (`run_residual_stack`)."""
        if self.kind == ATTENTION:
            return self.mixer(positions, hidden_states, residual, next_norm)
        return self.mixer(hidden_states, residual, next_norm)


class NemotronHModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embeddings = Embedding(config.vocab_size, config.hidden_size)
        pattern = config.layer_types
        # The i-th block of a kind uses the i-th cache layer of that kind.
        self.layers = nn.ModuleList(
            NemotronHBlock(config, kind, pattern[:index].count(kind))
            for index, kind in enumerate(pattern)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return run_residual_stack(self.layers, positions, self.embeddings(input_ids),
                                  self.norm_f)


class NemotronHForCausalLM(CausalLM):
    packed_modules = QKV_PACKED

    def __init__(self, config: ModelConfig) -> None:
        if config.layer_types is None or config.mamba is None:
            raise ValueError("a NemotronH config.json needs hybrid_override_pattern (or "
                             "layers_block_type) with at least one Mamba layer and the "
                             "mamba_* fields")
        super().__init__(config)
        self.model = NemotronHModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def ignores_weight(self, name: str) -> bool:
        return name == "lm_head.weight" and self.config.tie_word_embeddings

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(named_tensors))


def _renamed(named_tensors: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """NVIDIA's own checkpoints name the stack `backbone`, transformers' `model`."""
    for name, tensor in named_tensors:
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        yield name, tensor

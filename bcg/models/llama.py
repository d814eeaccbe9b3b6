"""Llama family (Llama 2/3, SmolLM2, ...); Qwen2 and Qwen3 reuse it with their two changes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bcg.distributed.parallel_state import tensor_parallel
from bcg.graph import bridge_buffer
from bcg.layers.attention import Attention, kv_store_target
from bcg.layers.decode_stack import FusedDecodeStack
from bcg.layers.embedding import Embedding, LMHead
from bcg.layers.linear import ColumnParallelLinear, RowParallelLinear
from bcg.layers.norm import RMSNorm
from bcg.layers.rotary import RotaryEmbedding
from bcg.models.base import CausalLM, run_residual_stack
from bcg.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding | None,  # None: no positional encoding (NemotronH)
        qkv_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        tp = tensor_parallel()
        self.num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)
        self.head_dim = config.head_dim
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        kv_parts = min(tp.size, config.num_key_value_heads)  # fewer KV heads: replicated
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size],
                                             bias=qkv_bias, parts=[tp.size, kv_parts, kv_parts])
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.qk_norms = (self.q_norm, self.k_norm) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output added to `residual`, then normalised by `norm`:
        `(normed, residual)`."""
        return self.o_proj.add_and_norm(self.attend(positions, hidden_states), residual, norm)

    def attend(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The attention output before the o projection, `[T, local heads * head_dim]`."""
        # q, k, v cross attention's graph break: written into the layer-shared bridge.
        shape = (hidden_states.shape[0], self.qkv_proj.weight.shape[0])
        qkv = self.qkv_proj(hidden_states, out=bridge_buffer("qkv", shape, hidden_states.dtype,
                                                              hidden_states.device))
        q, k, v = qkv.split(self.qkv_proj.local_outputs, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        kv_store = None
        if self.rotary is not None:
            # One kernel on CUDA: norms, rotation and, in a decode step, the KV store.
            kv_store = kv_store_target(self.attn, v)
            q, k = self.rotary(positions, q, k, self.qk_norms, kv_store)
        out = self.attn(q, k, v, kv_stored=kv_store is not None)
        return out.view(-1, self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size],
                                                 bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output added to `residual`, then normalised by `norm`: `(normed,
        residual)`."""
        # SiLU-and-mul fused into the gate/up projection where the skinny kernel runs it
        activated = self.gate_up_proj(x, activation="silu_and_mul")
        return self.down_proj.add_and_norm(activated, residual, norm)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, self_attn: LlamaAttention, mlp: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states` normed by `input_layernorm` -> the next norm's input and the
        residual (`run_residual_stack`)."""
        hidden_states, residual = self.self_attn(positions, hidden_states, residual,
                                                 self.post_attention_layernorm)
        return self.mlp(hidden_states, residual, next_norm)


MLPFactory = Callable[[ModelConfig, int], nn.Module]  # (config, layer id) -> the layer's MLP


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool,
                 build_mlp: MLPFactory) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                LlamaAttention(config, layer_id, self.rotary, qkv_bias, qk_norm),
                build_mlp(config, layer_id), config,
            )
            for layer_id in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = FusedDecodeStack(self.layers, self.norm, self.rotary)

    def process_weights_after_loading(self) -> None:
        self.fused_decode.prepare()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.fused_decode.runs(hidden_states):
            return self.fused_decode(hidden_states, positions)
        return run_residual_stack(self.layers, positions, hidden_states, self.norm)


# The checkpoint's q, k and v projections load into LlamaAttention's merged qkv_proj.
QKV_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


class LlamaForCausalLM(CausalLM):
    packed_modules = {
        **QKV_PACKED,
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False  # Qwen2 always has q, k, v biases; Llama only with `attention_bias`
    qk_norm = False  # Qwen3 normalises each head of q and k before rotary

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, self.qkv_bias or config.attention_bias, self.qk_norm,
                                self.build_mlp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """The MLP of layer `layer_id` (mixture-of-experts models choose per layer)."""
        return LlamaMLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def ignores_weight(self, name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and self.config.tie_word_embeddings
        )

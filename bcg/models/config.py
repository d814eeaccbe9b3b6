"""The model hyper-parameters we use, parsed from a Hugging Face `config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (Qwen3-MoE); num_experts 0: every layer dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has experts (Hugging Face's rule for Qwen3-MoE)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        architectures = hf.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {architectures!r}"
            )
        heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(hf)
        return cls(
            architecture=architectures[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            rope_scaling=rope_scaling,
            eos_token_ids=as_id_list(hf.get("eos_token_id")),
            # Published configs say num_experts; transformers 5 saves num_local_experts.
            num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
            num_experts_per_tok=hf.get("num_experts_per_tok", 0),
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            norm_topk_prob=hf.get("norm_topk_prob", False),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
        )


def _parse_rope(hf: dict) -> tuple[float, dict | None]:
    """Both layouts: transformers 5 `rope_parameters`, and 4.x `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, (None if rope_type == "default" else params)


def as_id_list(value: int | list[int] | None) -> list[int]:
    """A config's token id field (absent, one id, or a list) as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]

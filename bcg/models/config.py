"""The model hyper-parameters we use, parsed from a Hugging Face `config.json` dict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# NemotronH's `hybrid_override_pattern`: one character per layer.
MAMBA, ATTENTION, MLP = "M", "*", "-"
_LAYER_TYPE_CHARS = {"linear_attention": MAMBA, "full_attention": ATTENTION, "mlp": MLP,
                     "moe": "E"}


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba2 mixer's shapes (NemotronH names)."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    # softplus(dt + dt_bias) is clamped into [low, high] (`time_step_limit`, by default
    # (0, inf): no clamp) in prefill and decode alike; `time_step_min` only initialises dt_bias.
    dt_limit: tuple[float, float]

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x | B | C."""
        return self.inner_size + 2 * self.n_groups * self.state_size


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
    # Hybrids: one of MAMBA, ATTENTION, MLP per layer, and the Mamba mixer's shapes.
    layer_types: str | None = None
    mamba: MambaConfig | None = None

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has experts (Hugging Face's rule for Qwen3-MoE)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (every layer but a hybrid's Mamba and MLP layers)."""
        if self.layer_types is None:
            return self.num_hidden_layers
        return self.layer_types.count(ATTENTION)

    @property
    def num_mamba_layers(self) -> int:
        """Layers with a recurrent state (conv and SSM) per sequence."""
        return 0 if self.layer_types is None else self.layer_types.count(MAMBA)

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        architectures = hf.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {architectures!r}"
            )
        heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(hf)
        layer_types = _parse_layer_types(hf)
        return cls(
            architecture=architectures[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=len(layer_types) if layer_types else hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=(hf.get("head_dim") or hf.get("attention_head_dim")
                      or hf["hidden_size"] // heads),
            rms_norm_eps=hf.get("rms_norm_eps", hf.get("layer_norm_epsilon", 1e-6)),
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
            layer_types=layer_types,
            mamba=_parse_mamba(hf) if layer_types and MAMBA in layer_types else None,
        )


def _parse_layer_types(hf: dict) -> str | None:
    """A hybrid's layer layout as a pattern string: transformers 5 saves `layers_block_type`
    (a list of names), older configs `hybrid_override_pattern`; None for other models."""
    pattern = hf.get("hybrid_override_pattern")
    if pattern is None and hf.get("layers_block_type") is not None:
        names = hf["layers_block_type"]
        unknown = sorted(set(names) - set(_LAYER_TYPE_CHARS))
        if unknown:
            raise ValueError(f"config.json: unknown layers_block_type entries {unknown}")
        pattern = "".join(_LAYER_TYPE_CHARS[name] for name in names)
    if pattern is None:
        return None
    unsupported = sorted(set(pattern) - {MAMBA, ATTENTION, MLP})
    if unsupported:
        raise ValueError(f"config.json: layer kinds {unsupported} of the hybrid pattern "
                         f"{pattern!r} are not supported (only M, * and -; no MoE layers)")
    return pattern


# Older NemotronH configs' names of Mamba fields (transformers still reads them, and they
# win over the current names when both are present, as there).
_LEGACY_MAMBA_KEYS = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
                      "chunk_size": "mamba_chunk_size", "use_conv_bias": "mamba_conv_bias",
                      "time_step_limit": "mamba_dt_limit"}
# What our NemotronH blocks compute, fixed: each field's one supported value (its default).
_FIXED_HYBRID_OPTIONS = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
                         "residual_in_fp32": False}


def _mamba_field(hf: dict, name: str, default):
    legacy = _LEGACY_MAMBA_KEYS.get(name)
    return hf[legacy] if legacy in hf else hf.get(name, default)


def _parse_mamba(hf: dict) -> MambaConfig:
    for name, supported in _FIXED_HYBRID_OPTIONS.items():
        if hf.get(name, supported) != supported:
            raise ValueError(f"config.json: {name}={hf[name]!r} is not supported (NemotronH "
                             f"runs here with {name}={supported!r} only)")
    heads = hf["mamba_num_heads"]
    groups = _mamba_field(hf, "n_groups", 8)
    if heads % groups:
        raise ValueError(f"config.json: mamba_num_heads={heads} is not a multiple of "
                         f"n_groups={groups}")
    return MambaConfig(
        num_heads=heads,
        head_dim=hf["mamba_head_dim"],
        state_size=hf["ssm_state_size"],
        n_groups=groups,
        conv_kernel=_mamba_field(hf, "conv_kernel", 4),
        chunk_size=_mamba_field(hf, "chunk_size", 128),
        conv_bias=_mamba_field(hf, "use_conv_bias", True),
        proj_bias=hf.get("use_bias", False),
        dt_limit=_parse_dt_limit(hf),
    )


def _parse_dt_limit(hf: dict) -> tuple[float, float]:
    """`time_step_limit` (older configs: `mamba_dt_limit`), (0, inf) when absent, as
    mamba_ssm's Mamba2 defaults. Its chunked scan clamps with it and its one-token step does
    not; transformers clamps its chunked path at `time_step_min` instead and its decode not
    at all. We clamp both, so a token's step size never depends on how it was batched; with
    the default limit all of these agree."""
    limit = _mamba_field(hf, "time_step_limit", (0.0, math.inf))
    bounds = tuple(float(value) for value in limit)
    if len(bounds) != 2 or not 0.0 <= bounds[0] <= bounds[1]:
        raise ValueError(f"config.json: time_step_limit={list(limit)} must be [low, high] "
                         "with 0 <= low <= high")
    return bounds


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

"""GGUF files (llama.cpp): a Hugging Face config from the metadata, tensors under their
Hugging Face names, dequantised to fp32."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from bcg.loader.gguf_reader import GGUFFile

# GGUF `general.architecture` -> Hugging Face architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# All experts of a layer in one tensor, `[experts, rows, columns]`.
_STACKED_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_DENSE_MLP = re.compile(r"blk\.(\d+)\.ffn_gate\.weight")


def read_gguf_config(gguf: GGUFFile) -> dict:
    """The Hugging Face `config.json` equivalent of the file's metadata; ValueError naming the
    file if the metadata lacks a field the model needs (or holds the wrong kind of value)."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    names = {t.name for t in gguf.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{gguf.path}: GGUF files with baked rope frequencies (Llama 3.1 rope "
                         "scaling) are not supported: use the Hugging Face safetensors folder "
                         "instead")
    if "token_embd.weight" not in names:
        raise ValueError(f"{gguf.path} has no token_embd.weight tensor: not a complete model")

    def required(key: str, kind: type | tuple[type, ...] = int):
        if key not in meta:
            raise ValueError(f"{gguf.path}: GGUF metadata lacks {key!r}")
        return checked(key, kind)

    def checked(key: str, kind: type | tuple[type, ...] = int, default=None):
        value = meta.get(key, default)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(f"{gguf.path}: GGUF metadata {key!r} is {value!r}, not a "
                             f"{getattr(kind, '__name__', 'number')}")
        return value

    number = (int, float)
    heads = required(f"{arch}.attention.head_count")
    moe = {}
    if f"{arch}.expert_count" in meta:
        moe = {
            "num_experts": required(f"{arch}.expert_count"),
            "num_experts_per_tok": required(f"{arch}.expert_used_count"),
            "moe_intermediate_size": required(f"{arch}.expert_feed_forward_length"),
            # llama.cpp always renormalises Qwen3-MoE's top-k routing weights.
            "norm_topk_prob": meta.get(f"{arch}.expert_weights_norm", True),
            # GGUF has no mlp_only_layers: the layers holding a dense MLP are they.
            "mlp_only_layers": sorted(int(m.group(1)) for m in map(_DENSE_MLP.fullmatch, names)
                                      if m),
        }
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": len(required("tokenizer.ggml.tokens", list)),
        "hidden_size": required(f"{arch}.embedding_length"),
        "intermediate_size": required(f"{arch}.feed_forward_length"),
        "num_hidden_layers": required(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": checked(f"{arch}.attention.head_count_kv", int, heads),
        "head_dim": checked(f"{arch}.attention.key_length"),
        "rms_norm_eps": required(f"{arch}.attention.layer_norm_rms_epsilon", number),
        "rope_theta": checked(f"{arch}.rope.freq_base", number, 10000.0),
        "max_position_embeddings": required(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": checked("tokenizer.ggml.eos_token_id"),
        **moe,
    }


def iter_gguf_tensors(gguf: GGUFFile, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, dequantised to fp32, under its Hugging Face name (stacked experts as
    one tensor per expert, as Hugging Face checkpoints hold them)."""
    permute_qk = config["architectures"][0] == "LlamaForCausalLM"
    for tensor in gguf.tensors:
        stacked = _STACKED_EXPERTS.fullmatch(tensor.name)
        if stacked:
            layer, projection = stacked.groups()
            prefix = f"model.layers.{layer}.mlp.experts"
            for expert, weight in enumerate(torch.from_numpy(gguf.dequantized(tensor))):
                yield f"{prefix}.{expert}.{projection}_proj.weight", weight
            continue
        name = hf_tensor_name(tensor.name)
        weight = torch.from_numpy(gguf.dequantized(tensor))
        if permute_qk and ".q_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif permute_qk and ".k_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        yield name, weight


def hf_tensor_name(gguf_name: str) -> str:
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in our models")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion, which interleaves the two rotary halves of each head's rows
    (its rotary pairs adjacent dimensions; ours pairs dimension i with i + head_dim / 2)."""
    return weight.reshape(num_heads, -1, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


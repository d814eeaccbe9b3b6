"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections."""

from __future__ import annotations

from bcg.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True

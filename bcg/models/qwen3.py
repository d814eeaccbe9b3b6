"""Qwen3 (dense): Llama with an RMSNorm on each head of q and k before rotary."""

from __future__ import annotations

from bcg.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

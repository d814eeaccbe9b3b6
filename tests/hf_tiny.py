"""Tiny random Hugging Face models saved as folders, and a paged harness over our runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    NemotronHConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from bcg.config import EngineConfig
from bcg.engine.block_manager import BlockManager
from bcg.engine.llm_engine import prefix_caching_enabled
from bcg.engine.sampling_params import SamplingParams
from bcg.engine.sequence import Sequence
from bcg.runner.model_runner import ModelRunner
from tests.numerics import relative_error

VOCAB = 160
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
ARCHS = {
    "llama": lambda: LlamaConfig(**SIZES, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "qwen2": lambda: Qwen2Config(**SIZES, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=32, tie_word_embeddings=False),
    # 4 experts, top-2; the middle layer dense (mlp_only_layers), the others sparse.
    "qwen3_moe": lambda: Qwen3MoeConfig(**{**SIZES, "num_hidden_layers": 3}, head_dim=32,
                                        num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, mlp_only_layers=[1],
                                        norm_topk_prob=True, tie_word_embeddings=False),
}
# A hybrid with every block kind; chunks of 8 tokens, so prompts span several.
HYBRID_ARCHS = {
    "nemotron_h": lambda: NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, hybrid_override_pattern="M*-M-M",
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        max_position_embeddings=256),
}


def save_tiny_model(arch: str, folder: Path, max_shard_size: str = "50GB", **overrides):
    """Save a random model of `arch` (weights large enough for confident logits), its config
    changed by `overrides`; return it."""
    torch.manual_seed(0)
    config = (ARCHS | HYBRID_ARCHS)[arch]()
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return model


def save_tiny_model_and_greedy(arch: str, folder: Path, prompts: list[list[int]],
                               max_tokens: int) -> tuple[Path, list[list[int]]]:
    """A tiny random `arch` saved in `folder`, and transformers' greedy tokens per prompt."""
    hf_model = save_tiny_model(arch, folder)
    return folder, [hf_greedy(hf_model, p, max_tokens) for p in prompts]


# (device, dtype, tolerance) of our logits against transformers' fp32 CPU ones (the reasons
# for each tolerance: test_models_hf's docstring).
RUNS = [
    pytest.param(("cpu", "float32", 1e-4), id="cpu-fp32"),
    pytest.param(("cuda", "float32", 5e-3), id="cuda-fp32", marks=pytest.mark.gpu),
    pytest.param(("cuda", "bfloat16", 3e-2), id="cuda-bf16", marks=pytest.mark.gpu),
]


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def assert_rows_match(tiny, seq, rows: torch.Tensor, start: int) -> None:
    """`rows` (our logits of `seq` from position `start` on) against transformers', for a
    `tiny` fixture's (hf_model, harness, tolerance)."""
    hf_model, _, tolerance = tiny
    ref = hf_logits(hf_model, seq.token_ids[: start + len(rows)])[start:]
    assert relative_error(rows.cpu(), ref) <= tolerance


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([token_ids], device=device)).logits[0].float()


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(hf_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


class PagedHarness:
    """Our runner and block manager, stepped by hand: each step names the sequences and how
    many of their tokens to compute, and returns the logits of every computed row."""

    def __init__(self, folder: Path, device: str = "cpu", dtype: str = "float32",
                 block_size: int = 4, max_model_len: int = 256, **engine_args):
        engine_args.setdefault("kv_cache_tokens", 1024)
        config = EngineConfig(model=str(folder), device=device, dtype=dtype,
                              block_size=block_size, **engine_args)
        self.runner = ModelRunner(config, config.model_source(), max_model_len=max_model_len)
        slots = self.runner.num_state_slots
        self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size,
                                          prefix_caching_enabled(config, slots),
                                          num_state_slots=slots)

    def new_sequence(self, token_ids: list[int]) -> Sequence:
        seq = Sequence(str(id(token_ids)), token_ids, SamplingParams(temperature=0))
        seq.num_computed_tokens = self.block_manager.allocate_cached_prefix(seq)
        return seq

    def step(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[torch.Tensor]:
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            assert self.block_manager.try_allocate(seq, n)
        batch = self.runner.prepare(seqs, num_new_tokens)
        with torch.inference_mode():
            logits = self.runner.model.compute_logits(self.runner.forward(batch)).float()
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
        return list(logits.split(num_new_tokens))

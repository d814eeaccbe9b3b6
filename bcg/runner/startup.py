"""A rank's runner from the engine's config: what rank 0's engine and every other
tensor-parallel rank build alike (the workers import no more than this: no tokenizer)."""

from __future__ import annotations

import torch

from bcg.config import EngineConfig, require
from bcg.loader.model_source import ModelSource
from bcg.models.config import ModelConfig
from bcg.runner.graph_verify import verify_graphs
from bcg.runner.model_runner import ModelRunner
from bcg.timing import startup_step


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if config.max_model_len is None:
        return limit
    require(config.max_model_len <= limit,
            f"max_model_len={config.max_model_len} exceeds the model's context length {limit}")
    return config.max_model_len


def start_runner(config: EngineConfig, source: ModelSource | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> ModelRunner:
    """This rank's runner: weights, graphs, KV cache, then --verify-graphs. Every
    tensor-parallel rank builds its own this way, so their start-up collectives meet."""
    if source is None:
        source = config.model_source()
    torch.manual_seed(config.seed)
    runner = ModelRunner(config, source, resolve_max_model_len(config, source.config),
                         eos_token_ids)
    if config.verify_graphs and runner.graph_runners:
        with startup_step("--verify-graphs"):
            verify_graphs(runner)
    return runner

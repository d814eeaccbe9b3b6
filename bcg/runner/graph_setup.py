"""Which graph runners an engine gets, from its config and device."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from bcg.config import EngineConfig, parse_sizes
from bcg.runner.buckets import DECODE_BATCH_SIZES, PREFILL_TOKENS, ladder
from bcg.runner.graph_runner import DecodeGraphRunner, PrefillGraphRunner, StackSpec

if TYPE_CHECKING:
    from bcg.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def graph_modes(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """(decode mode, prefill mode), each "none" for eager; debug mode replaces the others."""
    if device.type != "cuda":
        if (config.decode_graph, config.prefill_graph) != ("none", "none"):
            logger.info("CUDA graphs need a CUDA device: every step runs eagerly on %s", device)
        return "none", "none"
    if config.debug_cuda_graph:
        return tuple("none" if m == "none" else "debug"  # type: ignore[return-value]
                     for m in (config.decode_graph, config.prefill_graph))
    return config.decode_graph, config.prefill_graph


def build_graph_runners(
    runner: ModelRunner, config: EngineConfig, max_model_len: int
) -> tuple[DecodeGraphRunner | None, PrefillGraphRunner | None]:
    """The decode and prefill graph runners the config asks for (not captured yet)."""
    decode_mode, prefill_mode = graph_modes(config, runner.device)
    spec = StackSpec(runner.model, runner.forward_context, runner.device,
                     runner.model_config.hidden_size, runner.dtype)
    decode = prefill = None
    if decode_mode != "none":
        buckets = ladder(parse_sizes(config.decode_graph_bs), DECODE_BATCH_SIZES,
                         config.max_num_seqs)
        decode = DecodeGraphRunner(
            spec, decode_mode, buckets,
            max_blocks_per_seq=-(-max_model_len // config.block_size),
            max_seq_len=max_model_len,
        )
    if prefill_mode != "none":
        buckets = ladder(parse_sizes(config.prefill_graph_tokens), PREFILL_TOKENS,
                         config.max_num_batched_tokens)
        if prefill_mode == "piecewise":
            spec = dataclasses.replace(spec, stack=torch.compile(runner.model, dynamic=True))
        prefill = PrefillGraphRunner(spec, prefill_mode, buckets, block_size=config.block_size)
    return decode, prefill

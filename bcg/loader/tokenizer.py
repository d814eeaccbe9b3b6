"""Tokenizers through transformers: from a model folder, a Hub id, or a GGUF's vocabulary."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bcg.loader.model_source import ModelSource


def load_tokenizer(
    source: ModelSource, override: str | None = None
) -> PreTrainedTokenizerBase | None:
    """`override` (a folder or Hub id) wins; else the model's own; None if it has none."""
    if override is not None:
        return AutoTokenizer.from_pretrained(override)
    path = source.tokenizer_path
    if path is None:
        return None
    if source.gguf_tokenizer:
        return _gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

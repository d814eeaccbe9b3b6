"""Tokenizers through transformers: from a model folder, a Hub id, or a GGUF's vocabulary.

Building a tokenizer from a GGUF takes transformers many seconds, so the result is saved
once under the user cache directory and loaded from there afterwards.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bcg.loader.model_source import ModelSource

logger = logging.getLogger(__name__)


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


def tokenizer_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "bcg" / "tokenizers"


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    stat = path.stat()
    cached = tokenizer_cache_dir() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _save_atomically(tokenizer, cached)
    return tokenizer


def _save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write to a temporary folder, then rename: concurrent processes never see half a cache.
    Failing to cache (read-only home, another process won the rename) costs only time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=target.parent)
    except OSError as error:
        logger.debug("no tokenizer cache at %s: %s", target, error)
        return
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError as error:
        logger.debug("tokenizer cache not written to %s: %s", target, error)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

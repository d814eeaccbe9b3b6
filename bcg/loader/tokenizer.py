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

from bcg.loader.model_source import ERROR_LIMIT, TOKENIZER_FILES, ModelSource, classify_name
from bcg.utils import one_line

logger = logging.getLogger(__name__)


def load_tokenizer(
    source: ModelSource, override: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase | None:
    """`override` (a folder, a .gguf file or a Hub id) wins; else the model's own; None if
    it has none. A missing path or a tokenizer that does not load raises ValueError naming
    it; only a name shaped like a Hub id (`org/name`) that is no local path goes to the Hub.
    `trust_remote_code` lets transformers run a tokenizer's own code from its folder."""
    if override is not None:
        return _load_override(override, trust_remote_code)
    path = source.tokenizer_path
    if path is None:
        return None
    if source.gguf_tokenizer:
        return _gguf_tokenizer(path)
    return _from_pretrained(str(path), f"the tokenizer of {path}",
                            trust_remote_code=trust_remote_code)


def _load_override(name: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    kind, path = classify_name(name, "tokenizer")
    if kind == "folder":
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"tokenizer folder {name!r} has none of {', '.join(TOKENIZER_FILES)}")
        return _from_pretrained(str(path), f"tokenizer {name!r}",
                                trust_remote_code=trust_remote_code)
    if kind == "gguf":
        return _gguf_tokenizer(path)
    if kind == "file":
        raise ValueError(f"tokenizer {name!r} is a file: pass the folder holding it (or a "
                         ".gguf file)")
    if kind == "hub":
        return _from_pretrained(name, f"tokenizer {name!r} (not a local path, so from the "
                                      "Hugging Face Hub)", trust_remote_code=trust_remote_code)
    raise ValueError(f"tokenizer {name!r} is neither a local folder nor a Hub id (org/name)")


def _from_pretrained(name: str, what: str, **kwargs) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"could not load {what}: {one_line(error, ERROR_LIMIT)}") from None


def tokenizer_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "bcg" / "tokenizers"


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    stat = path.stat()
    cached = tokenizer_cache_dir() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if cached.is_dir():
        return _from_pretrained(str(cached), f"the cached tokenizer {cached}")
    tokenizer = _from_pretrained(str(path.parent), f"the tokenizer of {path}",
                                 gguf_file=path.name)
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

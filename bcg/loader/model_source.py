"""Resolves what the user names as `model` into a config, a weight stream and a tokenizer.

`model` may be: None (the built-in SmolLM2-135M-Instruct GGUF), a Hugging Face folder, a
.gguf file (or a folder holding exactly one), a preset name (dummy weights), or a Hugging
Face Hub id `org/name` (downloaded when `huggingface_hub` can reach the Hub).

Local paths win: only a name shaped like `org/name` that is no local path goes to the Hub;
any other missing path is reported as a path that does not exist. Files that cannot be read
as what they claim to be raise ValueError naming the file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from bcg.loader.builtin import BUILTIN_NAME, builtin_gguf_path
from bcg.loader.gguf_file import iter_gguf_tensors, read_gguf_config
from bcg.loader.gguf_reader import GGUF_MAGIC, GGUFFile
from bcg.loader.hf_folder import iter_safetensors, read_generation_eos, read_hf_config
from bcg.models.config import ModelConfig
from bcg.models.presets import PRESETS
from bcg.models.registry import ARCHITECTURES
from bcg.utils import is_int, one_line, warn_once

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_FILE_SUFFIXES = (".gguf", ".json", ".safetensors", ".bin")
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings")
_MOE_POSITIVE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")

ERROR_LIMIT = 300  # characters of a library's error quoted in ours

WeightStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    weights: WeightStream | None  # None: dummy (random) weights
    tokenizer_path: Path | None  # folder, or .gguf file; None: no tokenizer
    gguf_tokenizer: bool = False
    hf_overrides: dict = field(default_factory=dict)  # applied to the config


def resolve_model(model: str | None, dummy_weights: bool = False,
                  hf_overrides: dict | None = None) -> ModelSource:
    """Where `model`'s config, weights and tokenizer come from; with `dummy_weights` the
    weights are left out (random ones are drawn at load). `hf_overrides` replaces fields of
    the Hugging Face config (or a GGUF file's, or a preset's) before the model config is
    built from it."""
    source = _resolve_weights(model, hf_overrides or {})
    source.hf_overrides = hf_overrides or {}
    if dummy_weights:
        source.weights = None
    return source


def _resolve_weights(model: str | None, overrides: dict) -> ModelSource:
    if model is None:
        return _gguf_source(builtin_gguf_path(), BUILTIN_NAME, overrides)
    if model in PRESETS:
        logger.info("%s is a preset: random (dummy) weights, no tokenizer", model)
        config = _model_config(PRESETS[model], f"preset {model}", overrides)
        return ModelSource(model, config, None, None)
    kind, path = classify_name(model, "model")
    if kind == "folder":
        return _folder_source(path, model, overrides)
    if kind == "gguf":
        return _gguf_source(path, model, overrides)
    if kind == "file":
        raise ValueError(f"model {model!r} is a file but not a GGUF file: pass a .gguf file or "
                         "a Hugging Face model folder")
    if kind == "hub":
        return _folder_source(_download_from_hub(model), model, overrides)
    raise ValueError(
        f"unknown model {model!r}: pass a Hugging Face folder, a .gguf file, a Hub id "
        f"(org/name), or a preset for dummy weights ({', '.join(sorted(PRESETS))}); "
        f"leave it out for the built-in {BUILTIN_NAME}"
    )


NameKind = Literal["folder", "gguf", "file", "hub", "unknown"]


def classify_name(name: str, what: str) -> tuple[NameKind, Path]:
    """What a model or tokenizer (`what`) name means, and its path: a local "folder", a
    "gguf" file (by its suffix or its magic bytes), another "file"; else a "hub" id
    (`org/name`: local paths win) or "unknown". A path that exists but is neither folder
    nor file, or a path-shaped name that does not exist, is a ValueError."""
    path = Path(name).expanduser()
    if path.is_dir():
        return "folder", path
    if path.is_file():
        is_gguf = path.suffix == ".gguf" or _starts_with(path, GGUF_MAGIC)
        return ("gguf" if is_gguf else "file"), path
    if path.exists():
        raise ValueError(f"{what} {name!r} is neither a folder nor a file")
    if is_hub_id(name):
        return "hub", path
    if looks_like_path(name):
        raise ValueError(f"{what} path {name!r} does not exist")
    return "unknown", path


def is_hub_id(name: str) -> bool:
    """Shaped like a Hugging Face Hub id, `org/name` (callers check local paths first)."""
    return (_HUB_ID.fullmatch(name) is not None and ".." not in name
            and not name.endswith(_FILE_SUFFIXES))


def looks_like_path(name: str) -> bool:
    """A name that can only mean a file or folder (so, if missing, is reported as a path)."""
    return ("/" in name or os.sep in name or name.startswith(("~", "."))
            or name.endswith(_FILE_SUFFIXES))


def _folder_source(folder: Path, name: str, overrides: dict) -> ModelSource:
    ggufs = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file() and len(ggufs) == 1:
        return _gguf_source(ggufs[0], name, overrides)
    config = _model_config(read_hf_config(folder), folder / "config.json", overrides)
    config.eos_token_ids = sorted({*config.eos_token_ids, *read_generation_eos(folder)})
    has_tokenizer = any((folder / f).is_file() for f in TOKENIZER_FILES)
    return ModelSource(name, config, lambda: iter_safetensors(folder),
                       folder if has_tokenizer else None)


def _gguf_source(path: Path, name: str, overrides: dict) -> ModelSource:
    gguf = GGUFFile(path)
    hf_config = read_gguf_config(gguf)
    weights = lambda: iter_gguf_tensors(gguf, hf_config)
    return ModelSource(name, _model_config(hf_config, path, overrides), weights, path, True)


def _model_config(hf_config: dict, origin: Path | str, overrides: dict) -> ModelConfig:
    """The model config of `hf_config` with `overrides` applied, or ValueError naming
    `origin` (and the overrides) if a needed field is missing or bad."""
    if overrides:
        hf_config = _overridden(hf_config, overrides, origin)
        origin = f"{origin} with hf_overrides {overrides}"
    architectures = hf_config.get("architectures") or []
    if len(architectures) == 1 and architectures[0] not in ARCHITECTURES:  # before its fields
        raise ValueError(f"{origin}: architecture {architectures[0]!r} is not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    try:
        config = ModelConfig.from_hf_dict(hf_config)
    except KeyError as error:
        raise ValueError(f"{origin} lacks {error.args[0]!r}, which the model needs") from None
    except (TypeError, ZeroDivisionError, AttributeError) as error:
        raise ValueError(f"{origin} holds a bad value ({error})") from None
    except ValueError as error:
        raise ValueError(f"{origin}: {error}") from None
    for name in _POSITIVE_FIELDS + (_MOE_POSITIVE_FIELDS if config.num_experts else ()):
        value = getattr(config, name)
        if not (is_int(value) and value > 0):
            raise ValueError(f"{origin}: {name} must be a positive integer, got {value!r}")
    if config.num_experts and config.num_experts_per_tok > config.num_experts:
        raise ValueError(f"{origin}: num_experts_per_tok ({config.num_experts_per_tok}) exceeds "
                         f"num_experts ({config.num_experts})")
    return config


def _overridden(hf_config: dict, overrides: dict, origin: Path | str) -> dict:
    absent = sorted(set(overrides) - set(hf_config))
    if absent:  # a typo, or a field with a default that the model reads: both are allowed
        warn_once(__name__, f"hf_overrides sets {', '.join(absent)}, which {origin} does not "
                  "have: a field the model does not read changes nothing")
    return {**hf_config, **overrides}


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(len(magic)) == magic
    except OSError:
        return False


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:
        raise ValueError(
            f"{repo_id!r} is not a local path, and fetching it from the Hugging Face Hub failed "
            f"({one_line(error, ERROR_LIMIT)}); pass a local folder or .gguf file instead"
        ) from None

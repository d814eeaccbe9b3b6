"""Resolves what the user names as `model` into a config, a weight stream and a tokenizer.

`model` may be: None (the built-in SmolLM2-135M-Instruct GGUF), a Hugging Face folder, a
.gguf file (or a folder holding exactly one), a preset name (dummy weights), or a Hugging
Face Hub id `org/name` (downloaded when `huggingface_hub` can reach the Hub).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bcg.loader.builtin import BUILTIN_NAME, builtin_gguf_path
from bcg.loader.gguf_file import iter_gguf_tensors, read_gguf_config
from bcg.loader.gguf_reader import GGUFFile
from bcg.loader.hf_folder import iter_safetensors, read_generation_eos, read_hf_config
from bcg.models.config import ModelConfig
from bcg.models.presets import PRESETS

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

WeightStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    weights: WeightStream | None  # None: dummy (random) weights
    tokenizer_path: Path | None  # folder, or .gguf file; None: no tokenizer
    gguf_tokenizer: bool = False


def resolve_model(model: str | None, dummy_weights: bool = False) -> ModelSource:
    """Where `model`'s config, weights and tokenizer come from; with `dummy_weights` the
    weights are left out (random ones are drawn at load)."""
    source = _resolve_weights(model)
    if dummy_weights:
        source.weights = None
    return source


def _resolve_weights(model: str | None) -> ModelSource:
    if model is None:
        return _gguf_source(builtin_gguf_path(), BUILTIN_NAME)
    if model in PRESETS:
        logger.info("%s is a preset: random (dummy) weights, no tokenizer", model)
        return ModelSource(model, ModelConfig.from_hf_dict(PRESETS[model]), None, None)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path, model)
    if path.is_dir():
        return _folder_source(path, model)
    if model.count("/") == 1 and not path.exists():
        return _folder_source(_download_from_hub(model), model)
    raise ValueError(
        f"unknown model {model!r}: pass a Hugging Face folder, a .gguf file, a Hub id "
        f"(org/name), or a preset for dummy weights ({', '.join(sorted(PRESETS))}); "
        f"leave it out for the built-in {BUILTIN_NAME}"
    )


def _folder_source(folder: Path, name: str) -> ModelSource:
    ggufs = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file() and len(ggufs) == 1:
        return _gguf_source(ggufs[0], name)
    config = ModelConfig.from_hf_dict(read_hf_config(folder))
    config.eos_token_ids = sorted({*config.eos_token_ids, *read_generation_eos(folder)})
    has_tokenizer = any((folder / f).is_file() for f in TOKENIZER_FILES)
    return ModelSource(name, config, lambda: iter_safetensors(folder),
                       folder if has_tokenizer else None)


def _gguf_source(path: Path, name: str) -> ModelSource:
    gguf = GGUFFile(path)
    hf_config = read_gguf_config(gguf)
    weights = lambda: iter_gguf_tensors(gguf, hf_config)
    return ModelSource(name, ModelConfig.from_hf_dict(hf_config), weights, path, True)


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:
        raise ValueError(
            f"could not fetch {repo_id!r} from the Hugging Face Hub ({error}); pass a local "
            f"folder or .gguf file instead"
        ) from error

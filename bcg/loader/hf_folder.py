"""Hugging Face model folders: config.json and one or more .safetensors files.

A file that is not JSON, is not a JSON object, or a weight file that safetensors cannot
open raises ValueError naming the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from bcg.models.config import as_id_list
from bcg.utils import is_int

# transformers 5 saves the floats JSON lacks as {"__float__": "Infinity"} (and -Infinity, NaN).
_TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _untag_float(obj: dict) -> dict | float:
    tag = obj.get("__float__") if len(obj) == 1 else None
    return _TAGGED_FLOATS.get(tag, obj) if isinstance(tag, str) else obj


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"), object_hook=_untag_float)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a JSON file (it is not UTF-8 text)") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    return read_json_object(path)


def read_generation_eos(folder: Path) -> list[int]:
    """EOS ids of `generation_config.json` (chat models often list more than config.json)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = read_json_object(path).get("eos_token_id")
    if not (eos is None or is_int(eos) or (isinstance(eos, list) and all(map(is_int, eos)))):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return as_id_list(eos)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every (shard) file, with its checkpoint name."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} has no .safetensors weights (PyTorch .bin checkpoints are not supported)"
        )
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as error:  # safetensors' own error type is not importable portably
            raise ValueError(f"{file} is not a valid safetensors file ({error}): an "
                             "incomplete download?") from None
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

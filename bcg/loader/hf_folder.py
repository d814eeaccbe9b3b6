"""Hugging Face model folders: config.json and one or more .safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from bcg.models.config import as_id_list


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    return json.loads(path.read_text())


def read_generation_eos(folder: Path) -> list[int]:
    """EOS ids of `generation_config.json` (chat models often list more than config.json)."""
    path = folder / "generation_config.json"
    return as_id_list(json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every (shard) file, with its checkpoint name."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} has no .safetensors weights (PyTorch .bin checkpoints are not supported)"
        )
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

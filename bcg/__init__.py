"""bcg: compact, compiler-free LLM inference on breakable CUDA graphs."""

__version__ = "0.1.0"

"""bcg: compact, compiler-free LLM inference on breakable CUDA graphs.

`from bcg import LLM, SamplingParams` as with vLLM. The names load on first use, so
`import bcg` alone does not import torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "bcg.engine.llm",
    "LLMEngine": "bcg.engine.llm_engine",
    "SamplingParams": "bcg.engine.sampling_params",
    "RequestOutput": "bcg.engine.outputs",
    "CompletionOutput": "bcg.engine.outputs",
    "Logprob": "bcg.engine.outputs",
    "EngineConfig": "bcg.config",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bcg' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""Whether mixture-of-experts layers split their experts over the tensor-parallel ranks.

Tensor parallel (the default) gives every rank all experts, each cut along its intermediate
dimension; expert parallel (`--enable-expert-parallel`) gives each rank whole experts, an
equal share of them. Either way the tokens are replicated on every rank (attention and dense
layers stay tensor parallel) and the experts' partial sums are all-reduced. Set it before
the model is built (the engine does, from `EngineConfig.enable_expert_parallel`).
"""

from __future__ import annotations

_enabled = False


def expert_parallel_enabled() -> bool:
    return _enabled


def set_expert_parallel(enabled: bool) -> None:
    global _enabled
    _enabled = enabled

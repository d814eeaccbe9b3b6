"""Whether mixture-of-experts layers split their experts over the tensor-parallel ranks, and
how tokens reach them.

Tensor parallel (the default) gives every rank all experts, each cut along its intermediate
dimension; expert parallel (`--enable-expert-parallel`) gives each rank whole experts, an
equal share of them. Attention and dense layers stay tensor parallel, so every rank holds
every token. Expert parallel dispatch (`--ep-dispatch`):
- 'allreduce': each rank computes its experts' part of every token, one all-reduce sums
  the parts (capturable in any CUDA graph);
- 'alltoall': each rank sends its slice of the tokens only to the ranks holding their
  experts and gathers the results (`bcg.layers.moe_alltoall`): steps of up to
  `fixed_block_tokens` tokens (the engine's `EngineConfig.alltoall_fixed_block_tokens`, at
  least its max_num_seqs: every decode step) in blocks padded to a fixed size, capturable
  in any CUDA graph; larger ones, and all under torch.compile, in sizes only the host
  knows, a graph break.
Set it before the model is built (the engine does, from `EngineConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

DISPATCH_MODES = ("allreduce", "alltoall")


@dataclass(frozen=True)
class ExpertParallel:
    enabled: bool = False
    dispatch: str = "allreduce"
    fixed_block_tokens: int = 0  # all-to-all steps up to this size exchange fixed-size blocks


_current = ExpertParallel()


def expert_parallel() -> ExpertParallel:
    return _current


def set_expert_parallel(enabled: bool, dispatch: str = "allreduce",
                        fixed_block_tokens: int = 0) -> None:
    global _current
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"ep_dispatch must be one of {', '.join(DISPATCH_MODES)}, got "
                         f"{dispatch!r}")
    _current = ExpertParallel(enabled, dispatch, fixed_block_tokens)

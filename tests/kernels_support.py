"""Shared set-up for the Triton kernel tests (a helper module: no tests here).

On a GPU the kernels run compiled in bf16 on realistic sizes; without one they run through
Triton's interpreter in fp32 on small sizes, which needs ``pip install --no-deps triton``
(3.7 or newer with numpy >= 2.4: older interpreters break on numpy 2.4's scalar rules).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import numpy
import pytest
import torch

import bcg.kernels  # noqa: F401  (first: turns on the interpreter before triton loads)
from bcg.layers.attention_ref import paged_attention_ref
from tests.numerics import poisoned_like
from tests.paged import scatter_blocks

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# bf16 inputs against an fp32 reference; fp32 interpreter runs are far tighter.
TOLERANCE = 1e-2 if ON_GPU else 1e-4
# (num_heads, num_kv_heads, head_dim, block_size): MHA, GQA 4 and 3, MQA, Qwen3-8B-like.
HEAD_SHAPES = [(4, 4, 64, 16), (8, 2, 128, 16), (12, 4, 64, 8), (8, 1, 128, 32), (32, 8, 128, 16)]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def kernels_skip_reason() -> str | None:
    """Why the kernels cannot run here, or None."""
    try:
        import triton
        import triton.language
    except ImportError:
        return "triton is not installed (CPU: pip install --no-deps triton==3.7.1)"
    old_interpreter = _version(triton.__version__) < (3, 7)
    if not ON_GPU and old_interpreter and _version(numpy.__version__) >= (2, 4):
        return (
            f"triton {triton.__version__}'s interpreter fails with numpy "
            f"{numpy.__version__}: install triton>=3.7 or numpy<2.4"
        )
    if not ON_GPU and type(triton.language.cdiv).__name__ != "InterpretedFunction":
        return (
            "triton was imported before bcg.kernels could turn on its interpreter: "
            "run the tests with TRITON_INTERPRET=1"
        )
    return None


def import_kernels(name: str) -> ModuleType:
    """Import ``bcg.kernels.<name>``, skipping the calling test module if it cannot run."""
    reason = kernels_skip_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
    return importlib.import_module(f"bcg.kernels.{name}")


@dataclass
class PagedBatch:
    """A varlen batch over a paged KV cache holding every sequence's whole KV."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_seqlens_q[-1])


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    generator: torch.Generator,
    padding_tokens: int = 0,
    max_blocks: int | None = None,
) -> PagedBatch:
    """Random q and caches; each sequence's blocks are scattered over a shuffled pool.

    Sequence i has ``q_lens[i]`` new tokens and ``seq_lens[i]`` KV positions (0: a padded
    row). ``padding_tokens`` extra rows of q follow the real tokens, as in a graph bucket.
    ``max_blocks`` fixes the block-table width (and so every shape) across calls.
    """
    needed = max(1, max(-(-n // block_size) for n in seq_lens))
    max_blocks = max_blocks or needed
    if max_blocks < needed:
        raise ValueError(f"max_blocks={max_blocks} < {needed} blocks the longest sequence needs")
    num_blocks = len(seq_lens) * max_blocks + 3
    block_tables = scatter_blocks([max_blocks] * len(seq_lens), num_blocks, generator)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DTYPE).to(DEVICE)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        q=rand(sum(q_lens) + padding_tokens, num_heads, head_dim),
        k_cache=rand(*cache_shape),
        v_cache=rand(*cache_shape),
        cu_seqlens_q=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        scale=head_dim**-0.5,
    )


def record_launches(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, launcher: str
) -> list[tuple[dict, dict]]:
    """Wrap ``module.<launcher>`` (a ``CachedLauncher``) to record each launch's constexprs
    and options: with the same device and dtypes, each distinct record is one compiled variant
    (the interpreter takes the slow path every time, so the launcher's own cache cannot tell).
    """
    launches = []
    launch = getattr(module, launcher)

    def recording_launch(grid, tensors, scalars, constexprs, **options) -> None:
        launches.append((constexprs, options))
        launch(grid, tensors, scalars, constexprs, **options)

    monkeypatch.setattr(module, launcher, recording_launch)
    return launches


def reference_attention(batch: PagedBatch) -> torch.Tensor:
    """The engine's PyTorch attention on ``batch`` (rows it skips come back poisoned)."""
    return paged_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale, out=poisoned_like(batch.q),
    )

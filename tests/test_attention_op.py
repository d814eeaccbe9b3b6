"""The attention op: reads the forward context, ignores padded rows, and gives the same result
through the Triton kernels (Triton's interpreter on the CPU) as through the reference."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bcg.forward import ForwardBatch, ForwardContext, KVCache, set_forward_context
from bcg.layers.attention import Attention
from bcg.layers.attention_backend import ReferenceAttention, TritonAttention
from tests.test_kernels_support import kernels_skip_reason  # loads bcg.kernels before triton

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 16


def make_batch(prefix_lens: list[int], new_lens: list[int]) -> tuple[ForwardBatch, KVCache]:
    """Sequences whose prefix K/V are already cached (random), with new tokens to attend."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    cache = KVCache(1, sum(blocks_per_seq) + 2, BLOCK, KV_HEADS, DIM, torch.float32,
                    torch.device("cpu"))
    cache.storage.normal_(generator=gen)
    order = torch.randperm(cache.num_blocks, generator=gen).tolist()
    tables, slots, start = [], [], 0
    for count, prefix, seq_len in zip(blocks_per_seq, prefix_lens, seq_lens, strict=True):
        table = order[start : start + count]
        start += count
        tables.append(table + [-1] * (max(blocks_per_seq) - count))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(prefix, seq_len)]
    cu = [0]
    for n in new_lens:
        cu.append(cu[-1] + n)
    batch = ForwardBatch(
        input_ids=torch.zeros(cu[-1], dtype=torch.int64), positions=torch.zeros(cu[-1]),
        slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        sample_indices=torch.tensor([c - 1 for c in cu[1:]]), num_tokens=cu[-1],
        num_seqs=len(new_lens), max_seqlen_q=max(new_lens), max_seq_len=max(seq_lens))
    return batch, cache


def qkv(num_tokens: int, padding: int = 0):
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(num_tokens, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
    pad = [torch.full((padding, t.shape[1], DIM), float("nan")) for t in tensors]
    return [torch.cat([t, p]) for t, p in zip(tensors, pad, strict=True)]


def reference(batch: ForwardBatch, cache: KVCache, q, k, v) -> tuple[torch.Tensor, KVCache]:
    """Output and cache after the reference path runs on a copy of `cache`."""
    copy = KVCache(1, cache.num_blocks, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    copy.storage.copy_(cache.storage)
    return run(batch, copy, q, k, v, ReferenceAttention()), copy


def run(batch: ForwardBatch, cache: KVCache, q, k, v, backend) -> torch.Tensor:
    """The attention layer's output on `batch` through `backend`."""
    context = ForwardContext(batch, cache, backend, backend.metadata(batch))
    with set_forward_context(context):
        return Attention(0, HEADS, KV_HEADS, DIM)(q, k, v)


def test_padded_rows_are_neither_read_nor_cached():
    batch, cache = make_batch([5, 0, 9], [3, 6, 1])
    n = batch.num_tokens
    q, k, v = qkv(n, padding=5)
    expected, expected_cache = reference(batch, cache, q[:n], k[:n], v[:n])
    output = run(batch, cache, q, k, v, ReferenceAttention())
    assert torch.equal(cache.storage, expected_cache.storage)
    assert torch.equal(output[:n], expected)


def test_attention_outside_a_forward_context_explains():
    q, k, v = qkv(2)
    with pytest.raises(RuntimeError, match="forward context"):
        Attention(0, HEADS, KV_HEADS, DIM)(q, k, v)


@pytest.mark.parametrize("prefix_lens,new_lens", [
    ([5, 0, 9], [3, 6, 1]),  # mixed: chunk over a prefix, fresh prompt, decode
    ([7, 12, 3], [1, 1, 1]),  # decode
])
def test_kernels_match_the_reference(prefix_lens, new_lens):
    if torch.cuda.is_available():
        pytest.skip("checks the op's wiring in the interpreter on CPU tensors; on a GPU the "
                    "kernel and graph-runner tests cover it")
    reason = kernels_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    batch, cache = make_batch(prefix_lens, new_lens)
    q, k, v = qkv(batch.num_tokens)
    expected, expected_cache = reference(batch, cache, q, k, v)
    out = run(batch, cache, q, k, v, TritonAttention(HEADS, KV_HEADS, DIM, q.device))
    assert torch.equal(cache.storage, expected_cache.storage)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_reference_path_runs_without_triton():
    """A CPU-only install has no Triton: the layers still import, the CPU gets the reference
    backend, and asking for CUDA says what to install."""
    script = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
from bcg.layers import triton_ops
from bcg.layers.attention_backend import ReferenceAttention, attention_backend
from tests.test_attention_op import make_batch, qkv, run
assert not triton_ops.HAVE_TRITON
backend = attention_backend(torch.device("cpu"), 4, 2, 16)
assert isinstance(backend, ReferenceAttention)
batch, cache = make_batch([5, 0], [3, 1])
assert run(batch, cache, *qkv(batch.num_tokens), backend).isfinite().all()
try:
    attention_backend(torch.device("cuda"), 4, 2, 16)
except RuntimeError as error:
    assert "pip install triton" in str(error)
else:
    raise AssertionError("a CUDA backend was chosen without Triton")
"""
    repo_root = Path(__file__).parent.parent
    subprocess.run([sys.executable, "-c", script], cwd=repo_root, check=True, timeout=120)

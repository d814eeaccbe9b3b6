"""The attention op: reads the forward context, ignores padded rows, and gives the same result
through the Triton kernels (Triton's interpreter on the CPU) as through the reference."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bcg.forward import ForwardBatch, KVCache
from bcg.layers.attention import Attention
from bcg.layers.attention_backend import ReferenceAttention, TritonAttention
from bcg.runner.batch import SyntheticSequence, build_batch
from tests.attention_batch import DIM, HEADS, KV_HEADS, copy_cache, make_batch, qkv, run
from tests.kernels_support import kernels_skip_reason  # loads bcg.kernels before triton


def reference(batch: ForwardBatch, cache: KVCache, q, k, v) -> tuple[torch.Tensor, KVCache]:
    """Output and cache after the reference path runs on a copy of `cache`."""
    copy = copy_cache(cache)
    return run(batch, copy, q, k, v, ReferenceAttention()), copy


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
    ([7, 12, 5, 0, 2], [1, 1, 3, 6, 1]),  # mixed, decodes first: split between the kernels
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


def test_a_batch_counts_its_leading_decodes():
    def seq(length: int, computed: int) -> SyntheticSequence:
        return SyntheticSequence(list(range(length)), [0, 1], num_computed_tokens=computed)

    seqs = [seq(5, 4), seq(6, 5), seq(3, 0), seq(7, 6)]
    assert build_batch(seqs, [1, 1, 3, 1], 4, torch.device("cpu")).num_decode_seqs == 2
    assert build_batch(seqs[2:], [3, 1], 4, torch.device("cpu")).num_decode_seqs == 0


def test_reference_path_runs_without_triton():
    """A CPU-only install has no Triton: the layers still import, the CPU gets the reference
    backend, and asking for CUDA says what to install."""
    script = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
from bcg.layers import triton_ops
from bcg.layers.attention_backend import ReferenceAttention, attention_backend
from tests.attention_batch import make_batch, qkv, run
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

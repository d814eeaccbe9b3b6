"""The split argmax of greedy sampling against `torch.argmax` (the interpreter off CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels_support import DEVICE, ON_GPU, import_kernels

argmax = import_kernels("argmax")

VOCABS = [151936, 49152, 1000, 7] if ON_GPU else [1000, 37, 7]
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_matches_torch_argmax(vocab: int, dtype: torch.dtype, rows: int):
    generator = torch.Generator().manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype).to(DEVICE)
    assert torch.equal(argmax.argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_go_to_the_lowest_index_across_splits():
    logits = torch.zeros(2, 1000, device=DEVICE)
    logits[0, [5, 400, 999]] = 3.0
    logits[1] = float("-inf")
    logits[1, [700, 900]] = -1.0
    assert argmax.argmax_rows(logits).tolist() == [5, 700]


def test_a_row_of_minus_infinity_picks_its_first_token():
    logits = torch.full((1, 1000), float("-inf"), device=DEVICE)
    assert argmax.argmax_rows(logits).tolist() == [0]


def test_a_nan_wins_over_every_number():
    logits = torch.randn(2, 1000, device=DEVICE)
    logits[0, [600, 300]] = float("nan")
    logits[1, 3] = float("inf")
    assert argmax.argmax_rows(logits).tolist() == [300, 3]


def test_repeated_calls_and_more_rows_reuse_the_workspace():
    for rows in (1, 4, 2):
        logits = torch.randn(rows, 1000, device=DEVICE)
        for _ in range(2):
            assert torch.equal(argmax.argmax_rows(logits), logits.argmax(dim=-1))


def test_rows_of_a_wider_tensor_are_read_by_their_stride():
    wide = torch.randn(3, 1200, device=DEVICE)
    logits = wide[:, :1000]
    assert torch.equal(argmax.argmax_rows(logits), logits.argmax(dim=-1))


def test_a_non_contiguous_row_is_refused():
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax.argmax_rows(torch.randn(1000, 2, device=DEVICE).t())


@pytest.mark.parametrize("logits, takes_kernel", [
    (torch.zeros(16, 100, dtype=torch.bfloat16), True),
    (torch.zeros(17, 100, dtype=torch.bfloat16), False),  # past a decode-sized step
    (torch.zeros(2, 3, 100), False),  # not [rows, vocab]
    (torch.zeros(2, 100, dtype=torch.float64), False),  # the kernel compares in fp32
    (torch.zeros(100, 2).t(), False),  # rows not contiguous
])
def test_the_sampler_takes_the_kernel_only_where_it_applies(monkeypatch, logits, takes_kernel):
    from bcg.layers import triton_ops

    calls = []
    monkeypatch.setattr(triton_ops, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(triton_ops, "argmax_rows_kernel", lambda x: calls.append(x) or x[:, 0])
    triton_ops.argmax_rows(logits)
    assert bool(calls) == takes_kernel


def test_a_graph_capture_takes_pytorchs_argmax(monkeypatch):
    from bcg.layers import triton_ops

    monkeypatch.setattr(triton_ops, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(triton_ops, "argmax_rows_kernel", lambda x: pytest.fail("kernel"))
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert triton_ops.argmax_rows(logits).tolist() == [1]

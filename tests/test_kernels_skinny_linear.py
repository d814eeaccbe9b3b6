"""The skinny linear kernel (decode-sized rows) against PyTorch: plain, with bias, with
SiLU-and-mul or squared ReLU fused on its output, on shapes whose N and K do and do not
divide its tiles, a strided input and a row count of zero; bad arguments are refused with
their shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels_support import DEVICE, DTYPE, ON_GPU, TOLERANCE, import_kernels
from tests.numerics import relative_error

skinny = import_kernels("skinny_linear")

ROWS = [1, 3, 8, 16]
# (N, K): tiles that divide both, and ones that leave a remainder of each
SHAPES = ([(4096, 2048), (3072, 4096), (1000, 1536), (1024, 1600)] if ON_GPU
          else [(32, 48), (37, 40)])


def rand(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * 0.1).to(DTYPE).to(DEVICE)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str | None) -> torch.Tensor:
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if activation == "silu_and_mul":
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    if activation == "relu_squared":
        out = torch.relu(out).square()
    return out


@pytest.mark.parametrize("activation", [None, "silu_and_mul", "relu_squared"],
                         ids=["plain", "silu-and-mul", "relu-squared"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_it_matches_pytorch(rows, n, k, with_bias, activation):
    generator = torch.Generator().manual_seed(rows * 7 + n + k)
    x = rand(rows, k, generator=generator)
    weight = rand(2 * n if activation == "silu_and_mul" else n, k, generator=generator)
    bias = rand(weight.shape[0], generator=generator) if with_bias else None
    out = skinny.skinny_linear(x, weight, bias, activation=activation)
    assert out.shape == (rows, n) and out.dtype == DTYPE
    assert relative_error(out, reference(x, weight, bias, activation)) <= TOLERANCE


def test_a_strided_input_and_an_output_view():
    generator = torch.Generator().manual_seed(0)
    n, k = SHAPES[-1]
    wide = rand(4, k + 8, generator=generator)
    x = wide[:, :k]  # rows a stride apart wider than K
    weight = rand(n, k, generator=generator)
    out = torch.zeros(4, n + 5, dtype=DTYPE, device=DEVICE)[:, :n]
    skinny.skinny_linear(x, weight, out=out)
    assert relative_error(out, reference(x, weight, None, None)) <= TOLERANCE


def test_no_rows_launch_nothing():
    n, k = SHAPES[0]
    weight = torch.zeros(n, k, dtype=DTYPE, device=DEVICE)
    assert skinny.skinny_linear(weight[:0], weight).shape == (0, n)


@pytest.mark.parametrize("rows, width, dtype, weight_rows, message", [
    (skinny.MAX_ROWS + 1, 48, DTYPE, 32, "at most 16 rows"),
    (2, 47, DTYPE, 32, "K columns"),
    (2, 48, torch.float16 if DTYPE != torch.float16 else torch.bfloat16, 32, "weight's dtype"),
    (2, 48, DTYPE, 33, r"\[2N, K\] under SiLU-and-mul"),
])
def test_bad_arguments_are_refused(rows, width, dtype, weight_rows, message):
    weight = torch.zeros(weight_rows, 48, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        skinny.skinny_linear(torch.zeros(rows, width, dtype=dtype, device=DEVICE), weight,
                             activation="silu_and_mul")


def test_an_unknown_activation_is_refused():
    weight = torch.zeros(32, 48, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="activation must be one of"):
        skinny.skinny_linear(weight[:2], weight, activation="gelu")


@pytest.mark.parametrize("activation", [None, "silu_and_mul", "relu_squared"])
def test_a_weight_fills_the_device_with_a_program_per_two_multiprocessors(activation):
    columns = skinny.CONFIGS.for_device(ON_GPU).block_n * (2 if activation == "silu_and_mul"
                                                           else 1)
    half = -(-skinny.multiprocessor_count(DEVICE) // 2)
    assert skinny.fills_device(torch.empty(columns * half, 8, device=DEVICE), activation)
    assert not skinny.fills_device(torch.empty(columns * (half - 1), 8, device=DEVICE),
                                   activation)

"""When layers use the fused Triton kernels of `bcg.kernels` instead of plain PyTorch ops.

On CUDA a layer issues one fused launch where PyTorch would issue several (the launches,
not the arithmetic, dominate small steps). Under `torch.compile` (the piecewise baseline)
layers stay plain PyTorch so the compiler sees and fuses them itself. Elsewhere the PyTorch
ops are the reference. The kernels are imported on first use: they need Triton.
"""

from __future__ import annotations

import torch


def use_fused_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and not torch.compiler.is_compiling()

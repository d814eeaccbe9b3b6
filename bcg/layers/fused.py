"""When layers use the fused Triton kernels of `bcg.kernels` instead of plain PyTorch ops.

On CUDA a layer issues one fused launch where PyTorch would issue several (the launches,
not the arithmetic, dominate small steps). Under `torch.compile` (the piecewise baseline)
layers stay plain PyTorch so the compiler sees and fuses them itself. Elsewhere the PyTorch
ops are the reference. The kernels are imported once here, not per call; they need Triton,
which a CPU-only install may lack.
"""

from __future__ import annotations

import torch

try:
    from bcg.kernels.activation import silu_and_mul
    from bcg.kernels.rmsnorm import add_rms_norm, rms_norm
    from bcg.kernels.rotary import apply_rotary

    HAVE_KERNELS = True
except ImportError:
    HAVE_KERNELS = False

__all__ = ["add_rms_norm", "apply_rotary", "rms_norm", "silu_and_mul", "use_fused_kernels"]


def use_fused_kernels(x: torch.Tensor) -> bool:
    return HAVE_KERNELS and x.is_cuda and not torch.compiler.is_compiling()

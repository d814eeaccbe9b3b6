"""The one place layers choose between the Triton kernels of `bcg.kernels` and PyTorch.

On CUDA a layer issues one fused launch where PyTorch would issue several (the launches,
not the arithmetic, dominate small steps), and attention runs our paged kernels. Under
`torch.compile` (the piecewise baseline) the small ops stay plain PyTorch so the compiler
sees and fuses them itself. Elsewhere the PyTorch ops are the reference. The Mamba2 mixer's
state ops run our kernels on CUDA too (`bcg.layers.mamba_backend`). The kernels are
imported once here, not per call; they need Triton, which a CPU-only install may lack.
"""

from __future__ import annotations

import torch

try:
    from bcg.kernels.activation import silu_and_mul
    from bcg.kernels.decode_attention import decode_attention, plan_decode
    from bcg.kernels.extend_attention import extend_attention
    from bcg.kernels.kv_store import store_kv
    from bcg.kernels.mamba_conv import causal_conv1d_update, causal_conv1d_varlen
    from bcg.kernels.mamba_scan import selective_state_update, ssd_scan_varlen
    from bcg.kernels.rmsnorm import add_rms_norm, rms_norm
    from bcg.kernels.rotary import apply_rotary

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

__all__ = ["add_rms_norm", "apply_rotary", "causal_conv1d_update", "causal_conv1d_varlen",
           "decode_attention", "extend_attention", "plan_decode", "rms_norm",
           "selective_state_update", "silu_and_mul", "ssd_scan_varlen", "store_kv",
           "use_fused_kernels", "uses_triton"]


def uses_triton(device: torch.device) -> bool:
    """Whether a model on `device` runs the Triton kernels (CUDA) or the reference."""
    if device.type != "cuda":
        return False
    if not HAVE_TRITON:
        raise RuntimeError("bcg on CUDA needs Triton's kernels, which failed to import: "
                           "pip install triton (the version your torch was built with)")
    return True


def use_fused_kernels(x: torch.Tensor) -> bool:
    return HAVE_TRITON and x.is_cuda and not torch.compiler.is_compiling()

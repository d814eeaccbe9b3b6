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
    from bcg.kernels._launch import multiprocessor_count
    from bcg.kernels.activation import relu_squared, silu_and_mul
    from bcg.kernels.argmax import MAX_ROWS as ARGMAX_MAX_ROWS
    from bcg.kernels.argmax import argmax_rows as argmax_rows_kernel
    from bcg.kernels.decode_attention import MAX_GRID_ROWS as MAX_DECODE_ROWS
    from bcg.kernels.decode_attention import decode_attention, plan_decode
    from bcg.kernels.decode_stack import StackShape, decode_stack
    from bcg.kernels.decode_stack import make_workspace as make_decode_stack_workspace
    from bcg.kernels.decode_stack import unsupported_reason as decode_stack_unsupported
    from bcg.kernels.extend_attention import extend_attention
    from bcg.kernels.fused_moe import fused_expert_choices
    from bcg.kernels.fused_moe import fused_experts as fused_experts_kernel
    from bcg.kernels.kv_store import store_kv
    from bcg.kernels.mamba_conv import causal_conv1d_update, causal_conv1d_varlen
    from bcg.kernels.mamba_scan import selective_state_update, ssd_scan_varlen
    from bcg.kernels.moe_routing import MAX_FUSED_ROUTER_TOKENS, route_hidden_top_k, route_top_k
    from bcg.kernels.rmsnorm import add_rms_norm, gated_rms_norm, rms_norm, sum_add_rms_norm
    from bcg.kernels.rotary import apply_rotary
    from bcg.kernels.skinny_linear import MAX_ROWS as SKINNY_MAX_ROWS
    from bcg.kernels.skinny_linear import fills_device, skinny_linear

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
    MAX_FUSED_ROUTER_TOKENS = 0

__all__ = ["MAX_DECODE_ROWS", "MAX_FUSED_ROUTER_TOKENS", "StackShape", "add_rms_norm",
           "apply_rotary", "argmax_rows", "causal_conv1d_update", "causal_conv1d_varlen",
           "decode_attention", "decode_stack", "decode_stack_unsupported", "extend_attention",
           "fused_expert_choices", "fused_experts", "gated_rms_norm",
           "make_decode_stack_workspace", "multiprocessor_count", "plan_decode", "relu_squared",
           "rms_norm", "route_hidden_top_k", "route_top_k", "selective_state_update",
           "silu_and_mul", "skinny_linear", "ssd_scan_varlen", "store_kv", "sum_add_rms_norm",
           "use_fused_kernels", "uses_fused_router", "uses_moe_kernel", "uses_skinny_linear",
           "uses_triton"]


ARGMAX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def uses_skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                       activation: str | None = None) -> bool:
    """Whether a linear layer takes `x` through the skinny kernel (with `activation` on its
    output: `bcg.kernels.skinny_linear.ACTIVATIONS`): decode-sized rows in a 16-bit dtype on
    CUDA, outside torch.compile, and a weight wide enough to keep the multiprocessors
    streaming (cuBLAS takes the rest)."""
    return (use_fused_kernels(x) and x.shape[0] <= SKINNY_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and fills_device(weight, activation))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: a decode-sized step's `[rows, vocab]` logits (16- or 32-bit
    floats, rows contiguous) on CUDA in the split kernel, which PyTorch reduces a row in one
    block of threads; not under graph capture (its workspace lives outside any graph)."""
    if (use_fused_kernels(logits) and logits.dim() == 2 and logits.shape[0] <= ARGMAX_MAX_ROWS
            and logits.stride(-1) == 1 and logits.dtype in ARGMAX_DTYPES
            and not torch.cuda.is_current_stream_capturing()):
        return argmax_rows_kernel(logits)
    return logits.argmax(dim=-1)


def uses_fused_router(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether a mixture-of-experts layer routes `x` from its hidden states in one launch
    (router GEMM and top-k): decode-sized steps on CUDA, outside torch.compile."""
    return (use_fused_kernels(x) and x.shape[0] <= MAX_FUSED_ROUTER_TOKENS
            and x.dtype == router_weight.dtype)


def uses_moe_kernel(x: torch.Tensor) -> bool:
    """Mixture-of-experts layers run the fused kernel on CUDA, compiled or not: the
    reference reads expert counts on the host, which neither a graph nor the compiler takes."""
    return HAVE_TRITON and x.is_cuda


def fused_experts(hidden_states: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The fused MoE kernel; under `torch.compile` an opaque op the compiler calls as is."""
    if torch.compiler.is_compiling():
        return torch.ops.bcg.fused_experts(hidden_states, gate_up, down, topk_weights, topk_ids)
    return fused_experts_kernel(hidden_states, gate_up, down, topk_weights, topk_ids)


if HAVE_TRITON:
    @torch.library.custom_op(
        "bcg::fused_experts", mutates_args=(),
        schema="(Tensor hidden_states, Tensor gate_up, Tensor down, Tensor topk_weights, "
               "Tensor topk_ids) -> Tensor",  # explicit: this module's annotations are strings
    )
    def _fused_experts_op(hidden_states: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_kernel(hidden_states, gate_up, down, topk_weights, topk_ids)

    @_fused_experts_op.register_fake
    def _(hidden_states: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(hidden_states)

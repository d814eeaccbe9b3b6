"""The experts of a mixture-of-experts layer in plain PyTorch: the CPU path, and the oracle
the fused Triton kernel (`bcg.kernels.fused_moe`) is tested against.

It loops over the experts that received tokens (reading their counts on the host), so it is
not capturable in a CUDA graph; on CUDA the kernel runs instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_ref(
    hidden_states: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t])`.

    Args:
        hidden_states: `[T, H]`.
        gate_up: `[E, 2 * I, H]`, each expert's gate rows then its up rows.
        down: `[E, H, I]`.
        topk_weights: `[T, K]` routing weights.
        topk_ids: `[T, K]` expert of each choice; -1 (an expert on another rank) adds nothing.

    Returns `[T, H]` in the dtype of `hidden_states`, accumulated in fp32.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden_states.shape[1], dtype=torch.float32,
                      device=hidden_states.device)
    flat_ids = topk_ids.flatten()
    for expert in flat_ids[flat_ids >= 0].unique().tolist():
        choices = (flat_ids == expert).nonzero().squeeze(1)
        tokens = choices // top_k
        gate, up = F.linear(hidden_states[tokens], gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert])
        weights = topk_weights.flatten()[choices, None]
        out.index_add_(0, tokens, expert_out.float() * weights.float())
    return out.to(hidden_states.dtype)

"""The Mamba2 mixer's state ops in plain PyTorch: the CPU path and the kernels' oracle.

Prefill runs a varlen batch (sequences packed along the token axis, `cu_seqlens` their
offsets): each sequence's causal conv and SSM scan start from its cached state when it has
tokens before this step (`seq_lens` > its new tokens) and a slot, else from zero, and leave
their final state in its slot (a fresh slot may still hold a finished sequence's state: it
is never read). A sequence whose slot is negative (start-up stand-ins, graph padding) keeps
no state. Decode steps each sequence by one token, from its state unless the token is its
first (a one-token prompt). Everything is computed in fp32 and written into `out`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                dt_limit: tuple[float, float]) -> torch.Tensor:
    """The step size of each token and head: softplus(dt + dt_bias) clamped into `dt_limit`."""
    low, high = dt_limit
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=low, max=high)


def _initial(cache: torch.Tensor, slot: int, has_prefix: bool) -> torch.Tensor:
    """A sequence's starting state: its cached one, or zeros."""
    if slot >= 0 and has_prefix:
        return cache[slot].float()
    return torch.zeros(cache.shape[1:], dtype=torch.float32, device=cache.device)


def _sequences(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
               state_slots: torch.Tensor) -> Iterator[tuple[int, int, int, bool]]:
    """(start, end, slot, has_prefix) of each sequence of a varlen batch."""
    cu, lens, slots = cu_seqlens.tolist(), seq_lens.tolist(), state_slots.tolist()
    for i, slot in enumerate(slots):
        start, end = cu[i], cu[i + 1]
        yield start, end, slot, lens[i] > end - start


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                      seq_lens: torch.Tensor, state_slots: torch.Tensor,
                      out: torch.Tensor) -> None:
    """Depthwise causal conv + SiLU over a varlen batch. x, out `[T, C]`, weight `[C, K]`,
    conv_state `[slots, K - 1, C]` (the K - 1 inputs before a sequence's first new token)."""
    taps = weight.shape[1]
    w = weight.float().t()  # [K, C]
    for start, end, slot, has_prefix in _sequences(cu_seqlens, seq_lens, state_slots):
        padded = torch.cat([_initial(conv_state, slot, has_prefix), x[start:end].float()])
        windows = padded.unfold(0, taps, 1)  # [L, C, K]
        y = torch.einsum("lck,kc->lc", windows, w)
        if bias is not None:
            y = y + bias.float()
        out[start:end] = F.silu(y).to(out.dtype)
        if slot >= 0:
            conv_state[slot] = padded[-(taps - 1):].to(conv_state.dtype)


def causal_conv1d_update_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_state: torch.Tensor, seq_lens: torch.Tensor,
                             state_slots: torch.Tensor, out: torch.Tensor) -> None:
    """One new token per sequence: x, out `[S, C]`; each slot's state shifts by one (a
    sequence of length 1, a one-token prompt, starts from zeros)."""
    cu = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    causal_conv1d_ref(x, weight, bias, conv_state, cu, seq_lens, state_slots, out)


def ssd_scan_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                 dt_limit: tuple[float, float], chunk_size: int, ssm_state: torch.Tensor,
                 cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Mamba2's SSM over a varlen batch, chunk by chunk (the state-space dual form).
    x, out `[T, H, P]`, dt `[T, H]` (before softplus), A, D, dt_bias `[H]`, B, C `[T, G, N]`,
    ssm_state `[slots, H, P, N]`."""
    heads_per_group = x.shape[1] // B.shape[1]
    dt = softplus_dt(dt, dt_bias, dt_limit)
    for start, end, slot, has_prefix in _sequences(cu_seqlens, seq_lens, state_slots):
        state = _initial(ssm_state, slot, has_prefix)
        span = slice(start, end)
        b = B[span].float().repeat_interleave(heads_per_group, dim=1)
        c = C[span].float().repeat_interleave(heads_per_group, dim=1)
        xs = x[span].float()
        for first in range(0, end - start, chunk_size):
            chunk = slice(first, first + chunk_size)
            y, state = _ssd_chunk(xs[chunk], dt[span][chunk], A.float(), b[chunk], c[chunk],
                                  state)
            out[span][chunk] = (y + D.float()[:, None] * xs[chunk]).to(out.dtype)
        if slot >= 0:
            ssm_state[slot] = state.to(ssm_state.dtype)


def _ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens: x `[L, H, P]`, dt `[L, H]`, B, C `[L, H, N]`, the state before
    it `[H, P, N]` -> (y without the D term `[L, H, P]`, the state after it)."""
    decay = torch.cumsum(dt * A, dim=0)  # [L, H]: log of the decay from the chunk's start
    # Token s's contribution reaches token l >= s decayed by exp(decay[l] - decay[s]).
    gap = decay[:, None, :] - decay[None, :, :]  # [l, s, H]
    causal = torch.ones(gap.shape[:2], dtype=torch.bool, device=x.device).tril()
    weights = torch.exp(gap.masked_fill(~causal[..., None], float("-inf")))
    scores = torch.einsum("lhn,shn->lsh", C, B) * weights
    dx = x * dt[..., None]
    y = torch.einsum("lsh,shp->lhp", scores, dx)
    y = y + torch.einsum("lhn,hpn->lhp", C, state) * torch.exp(decay)[..., None]
    to_end = torch.exp(decay[-1] - decay)  # [L, H]
    state = state * torch.exp(decay[-1])[:, None, None] + torch.einsum(
        "lhn,lhp->hpn", B * to_end[..., None], dx)
    return y, state


def selective_state_update_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                               B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                               dt_bias: torch.Tensor, dt_limit: tuple[float, float],
                               ssm_state: torch.Tensor, seq_lens: torch.Tensor,
                               state_slots: torch.Tensor, out: torch.Tensor) -> None:
    """One token per sequence: x, out `[S, H, P]`, dt `[S, H]`, B, C `[S, G, N]`; each
    sequence's state (zero without a slot or before its first token) advances by it."""
    cu = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    ssd_scan_ref(x, dt, A, B, C, D, dt_bias, dt_limit, 1, ssm_state, cu, seq_lens,
                 state_slots, out)

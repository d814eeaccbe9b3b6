"""The Mamba2 references (`bcg.layers.mamba_ref`, the CPU path and the kernels' oracle)
against the recurrence written token by token: varlen sequences spanning several chunks,
with and without a cached state, with and without a slot; decode ops likewise."""

import torch
import torch.nn.functional as F

from bcg.layers import mamba_ref
from tests.mamba_batch import MambaBatch, make_mamba_batch
from tests.numerics import relative_error

DT_LIMIT = (0.2, 1.5)  # binds on both sides for some tokens
CHUNK = 4
SHAPES = dict(heads=4, head_dim=4, groups=2, state_size=8, taps=4, num_slots=4)


def token_by_token(batch: MambaBatch) -> tuple[torch.Tensor, ...]:
    """(activated x|B|C, y, conv states, ssm states) from the recurrence, one token at a time."""
    conv_state, ssm_state = batch.conv_state.clone(), batch.ssm_state.clone()
    activated = torch.zeros_like(batch.xbc, dtype=torch.float32)
    cu, lens = batch.cu_seqlens.tolist(), batch.seq_lens.tolist()
    for i, slot in enumerate(batch.state_slots.tolist()):
        start, end = cu[i], cu[i + 1]
        starts_fresh = slot < 0 or lens[i] == end - start
        window = torch.zeros_like(conv_state[0]) if starts_fresh else conv_state[slot].clone()
        for t in range(start, end):
            window = torch.cat([window, batch.xbc[t : t + 1]])
            mixed = (window * batch.conv_weight.t()).sum(0) + batch.conv_bias
            activated[t] = F.silu(mixed)
            window = window[1:]
        if slot >= 0:
            conv_state[slot] = window
    x, B, C = batch.split(activated)
    repeat = batch.heads // batch.groups
    y = torch.zeros_like(x)
    dt = F.softplus(batch.dt + batch.dt_bias).clamp(*DT_LIMIT)
    for i, slot in enumerate(batch.state_slots.tolist()):
        start, end = cu[i], cu[i + 1]
        starts_fresh = slot < 0 or lens[i] == end - start
        h = torch.zeros_like(ssm_state[0]) if starts_fresh else ssm_state[slot].clone()
        for t in range(start, end):
            b, c = B[t].repeat_interleave(repeat, 0), C[t].repeat_interleave(repeat, 0)
            h = torch.exp(dt[t] * batch.A)[:, None, None] * h \
                + (dt[t][:, None] * x[t])[..., None] * b[:, None, :]
            y[t] = (h * c[:, None, :]).sum(-1) + batch.D[:, None] * x[t]
        if slot >= 0:
            ssm_state[slot] = h
    return activated, y, conv_state, ssm_state


def run_reference(batch: MambaBatch, decode: bool) -> tuple[torch.Tensor, ...]:
    activated = torch.empty_like(batch.xbc)
    args = (batch.xbc, batch.conv_weight, batch.conv_bias, batch.conv_state)
    if decode:
        mamba_ref.causal_conv1d_update_ref(*args, batch.seq_lens, batch.state_slots,
                                           activated)
    else:
        mamba_ref.causal_conv1d_ref(*args, batch.cu_seqlens, batch.seq_lens, batch.state_slots,
                                    activated)
    x, B, C = batch.split(activated)
    y = torch.empty_like(x)
    common = (x, batch.dt, batch.A, B, C, batch.D, batch.dt_bias, DT_LIMIT)
    if decode:
        mamba_ref.selective_state_update_ref(*common, batch.ssm_state, batch.seq_lens,
                                             batch.state_slots, y)
    else:
        mamba_ref.ssd_scan_ref(*common, CHUNK, batch.ssm_state, batch.cu_seqlens,
                               batch.seq_lens, batch.state_slots, y)
    return activated, y, batch.conv_state, batch.ssm_state


def check(batch: MambaBatch, decode: bool) -> None:
    expected = token_by_token(batch)
    for ours, ref in zip(run_reference(batch, decode), expected, strict=True):
        assert relative_error(ours, ref) < 1e-5


def test_varlen_prefill_with_and_without_cached_state():
    # Lengths 1, 2 (shorter than the conv window), 5 and 13 (several chunks); a prefix in
    # slot 2, one without a slot, fresh sequences in slots 0 and 3.
    batch = make_mamba_batch([1, 2, 5, 13], [0, 6, 3, 9], [0, 2, -1, 3], **SHAPES,
                             generator=torch.Generator().manual_seed(0),
                             device=torch.device("cpu"), dtype=torch.float32)
    check(batch, decode=False)


def test_decode_step_slotless_rows_and_a_one_token_prompt():
    # Slot 1's state belongs to a finished sequence: the one-token prompt must not read it.
    batch = make_mamba_batch([1] * 5, [5, 1, 3, 8, 0], [3, -1, 0, 2, 1], **SHAPES,
                             generator=torch.Generator().manual_seed(1),
                             device=torch.device("cpu"), dtype=torch.float32)
    check(batch, decode=True)

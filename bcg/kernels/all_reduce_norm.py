"""A tensor-parallel all-reduce, the residual add after it and the RMSNorm after that, in one
launch over buffers every rank has mapped (symmetric memory).

In a decode step of a tensor-parallel model each row-parallel projection's output is summed
over the ranks, added to the residual and normalised: an all-reduce launch then a norm
launch, each costing a few microseconds beyond its bytes. Here one program a row writes its
rank's part of the row into every peer's buffer (stores over NVLink need no answer, where
reading a peer's memory waits for one), signals every peer, waits for every peer's signal,
sums the parts in its own buffer in rank order (so every rank computes the same bits) and
adds and normalises the row as `bcg.kernels.rmsnorm.add_rms_norm` does.

The signals are call counters (`epochs`, one a row on each rank, the same on every rank as
all ranks make the same calls), so no reset is needed between calls and a CUDA graph can
replay the launch. Each rank's buffer has a slot per sender for each parity of the counter:
a peer writes a slot again only two calls later, after this rank's signal of the call
between, which it sends once it has read the slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels._launch import CachedLauncher, next_power_of_2, require_last_dim_contiguous

EPOCH_MASK = (1 << 30) - 1  # counters wrap below int32's limit


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, peers: PeerRows) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += sum over ranks of x` (the sum rounded to `x`'s dtype first, as an
    all-reduce's output would be), then `out = rms_norm(residual) * norm_weight`.

    Every rank of `peers` must make the same calls with the same shapes, in the same order.

    Args:
        x: `[rows, N]`, this rank's part, last dim contiguous; `peers.takes(x)`.
        residual: `[rows, N]`, `x`'s dtype, updated in place.
        norm_weight: `[N]`.
        peers: the ranks' mapped slots and signals.

    Returns `(out, residual)`, `out` new.
    """
    rows, width = x.shape
    if not peers.takes(x) or residual.shape != x.shape or residual.dtype != x.dtype \
            or norm_weight.shape != (width,):
        raise ValueError(
            f"all_reduce_add_rms_norm takes x and residual [rows, N] of the buffers' dtype "
            f"{peers.dtype}, rows x N at most {peers.slot_numel} and rows at most "
            f"{peers.max_rows}, and norm_weight [N]; got x {tuple(x.shape)} {x.dtype}, "
            f"residual {tuple(residual.shape)} {residual.dtype}, norm_weight "
            f"{tuple(norm_weight.shape)}")
    out = torch.empty_like(residual)
    for name, tensor in (("x", x), ("residual", residual)):
        require_last_dim_contiguous(name, tensor)
    block = next_power_of_2(width)
    _launch(
        (rows,),
        (x, residual, norm_weight, out, peers.data_ptrs, peers.flag_ptrs, peers.epochs),
        (float(eps),),
        {"N": width, "STRIDE_X": x.stride(0), "STRIDE_RES": residual.stride(0),
         "STRIDE_OUT": out.stride(0), "RANK": peers.rank, "WORLD": peers.world_size,
         "SLOT_NUMEL": peers.slot_numel, "EPOCH_MASK": EPOCH_MASK, "BLOCK": block},
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual


class PeerRows:
    """What the kernel needs of the ranks' mapped memory: for each rank the address of its
    `2 x world_size` slots of `slot_numel` elements (one per counter parity and sender) and
    of its `max_rows x world_size` int32 signals (zero before the first call), and this
    rank's row counters."""

    def __init__(self, data_addresses: list[int], flag_addresses: list[int], rank: int,
                 slot_numel: int, max_rows: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rank, self.world_size = rank, len(data_addresses)
        self.slot_numel, self.max_rows, self.dtype = slot_numel, max_rows, dtype
        self.data_ptrs = torch.tensor(data_addresses, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flag_addresses, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` (`[rows, N]`) fits: the buffers' dtype and device, rows x N within a
        slot and rows within the signals."""
        return (x.dim() == 2 and x.dtype == self.dtype and x.device == self.epochs.device
                and 0 < x.shape[0] <= self.max_rows and x.numel() <= self.slot_numel)


@triton.jit
def _all_reduce_add_norm_kernel(
    x_ptr, residual_ptr, norm_w_ptr, out_ptr, data_ptrs, flag_ptrs, epochs_ptr, eps,
    N: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_RES: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    SLOT_NUMEL: tl.constexpr,
    EPOCH_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = x_ptr.dtype.element_ty
    epoch = (tl.load(epochs_ptr + row) + 1) & EPOCH_MASK
    tl.store(epochs_ptr + row, epoch)
    row_offset = (epoch & 1) * WORLD * SLOT_NUMEL + row * N  # + sender x SLOT_NUMEL
    x = tl.load(x_ptr + row * STRIDE_X + cols, mask=mask, other=0.0)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_data = tl.load(data_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(peer_data + row_offset + RANK * SLOT_NUMEL + cols, x, mask=mask)
    tl.debug_barrier()  # the whole row stored before any peer hears of it
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    ahead = (epoch + 1) & EPOCH_MASK  # a peer may already have signalled its next call
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            seen = tl.atomic_add(own_flags + row * WORLD + peer, 0, sem="acquire", scope="sys")
            while (seen != epoch) & (seen != ahead):
                seen = tl.atomic_add(own_flags + row * WORLD + peer, 0, sem="acquire",
                                     scope="sys")
    tl.debug_barrier()
    own_data = tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype))
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for sender in tl.static_range(WORLD):  # rank order: the same sum on every rank
        if sender == RANK:
            total += x.to(tl.float32)
        else:
            # Past the caches: the slot held other values two calls ago.
            total += tl.load(own_data + row_offset + sender * SLOT_NUMEL + cols, mask=mask,
                             other=0.0, cache_modifier=".cv").to(tl.float32)
    residual_ptrs = residual_ptr + row * STRIDE_RES + cols
    summed = total.to(dtype).to(tl.float32)  # rounded, as the all-reduce's output would be
    hidden = (summed + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(residual_ptrs, hidden, mask=mask)
    hidden32 = hidden.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(hidden32 * hidden32, 0) / N + eps)
    normed = (hidden32 * inv_rms).to(dtype).to(tl.float32)
    weight = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * STRIDE_OUT + cols, (normed * weight).to(out_ptr.dtype.element_ty),
             mask=mask)


_launch = CachedLauncher(_all_reduce_add_norm_kernel)

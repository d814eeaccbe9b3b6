"""A tensor-parallel all-reduce of decode-sized rows in one launch over buffers every rank
has mapped, alone or with the residual add and the RMSNorm after it.

In a decode step of a tensor-parallel model each row-parallel projection's output is summed
over the ranks, added to the residual and normalised: an all-reduce launch then a norm
launch, each costing a few microseconds beyond its bytes. Here each program takes rows in
turn (at most one program per multiprocessor, so all run at once and none waits for a row
whose program on the peer cannot start) and, for each, writes its rank's part of the row
into every peer's buffer (stores over NVLink need no answer, where reading a peer's memory
waits for one), reads its own buffer until every peer's part has arrived, sums the parts in
rank order (so every rank computes the same bits) and either writes the sum or adds and
normalises the row as `bcg.kernels.rmsnorm.add_rms_norm` does. A row-parallel projection on
the skinny kernel can send its part itself instead (`send_tile`, from
`bcg.kernels.skinny_linear.projection_all_reduce_add_rms_norm`): each of its programs stores
its output tile in every rank's slot as it finishes, so the parts cross NVLink while the
projection's other programs still run, and the reduce after it (`gathered_add_rms_norm`)
only waits, sums, adds and normalises.

The data is its own signal (the one-shot "Lamport" scheme): an empty slot holds negative
zeros (`EMPTY`), a sender sends its negative zeros as positive ones, so a part has arrived
once none of its elements is a negative zero, and the receiver empties the slot once it has
read it. No store waits for an answer and no fence waits for stores: a row costs one trip
over NVLink (a signal after the data cost a second, about 1 µs a call). Each rank's buffer
has a slot per sender for each parity of a row's call count (`epochs`, the same on every
rank as all ranks make the same calls), and a row has the same place in a slot whatever the
width of the call: a peer writes a slot again two calls of that row later, once it has this
rank's part of the call between, which this rank sends in a later launch than the one that
emptied the slot. That order comes from the stream (the launches of a rank run one after
another), not from fences. A launch may start early (programmatic dependent launch,
`bcg.kernels._pdl`) only because every kernel launched so waits for the one ahead before
its first memory access: each kernel's completion then implies its predecessor's, and the
order holds along the whole chain. A kernel launched early without that wait, or a second
stream, would let a peer refill a slot not yet emptied (wrong sums or a hang). So no reset
is needed between calls and a CUDA graph can replay the launch. The reduce's programs are
all resident before any of them lets the next kernel start, so that kernel's early
programs, waiting on its multiprocessors, cannot keep a reduce program from running.

A wait has no deadline (one on the GPU's timer was tried and did not work: README, Tensor
parallelism); instead the host can end a rank's waits for good (`release_waits`, when a
peer died) by setting a flag in its pinned memory, which a wait reads every `RELEASE_POLL`
spins. Only the CPU writes the flag, with no CUDA call: a copy to the device would queue
behind the spinning kernel (it did, in an engine's step), and the GPU reads host memory
directly. Those reads are rare on purpose: at one every 1024 spins, waits that ran past the
first read came out slower, so the peer's next wait did too, and both ranks stayed in that
state for whole steps (a 7 ms decode step took 50 ms: README, Tensor parallelism). A wait
that sees the release notes it in device memory (`release_seen`), which every later wait
that is not answered at once reads on its first spin, so they end at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._launch import (
    CachedLauncher,
    multiprocessor_count,
    next_power_of_2,
    require_last_dim_contiguous,
)
from bcg.kernels.rmsnorm import add_rms_norm_loaded

EPOCH_MASK = (1 << 30) - 1  # counters wrap below int32's limit
RELEASE_POLL = 1 << 16  # spins between reads of the host's release flag (a read crosses PCIe)
EMPTY = -0.0  # what an empty slot holds: no part is sent with a negative zero (the kernel's
# _is_empty and _empty_like spell it by its bits, 0x8000 and 0x80000000)


def all_reduce_rows(x: torch.Tensor, peers: PeerRows) -> torch.Tensor:
    """The sum over ranks of `x` (`[rows, N]`, `peers.takes(x)`), in a new tensor, the same
    bits on every rank. Every rank of `peers` must make the same calls with the same shapes,
    in the same order."""
    if not peers.takes(x):
        raise ValueError(f"all_reduce_rows takes x {fitting(peers)}; got x {_described(x)}")
    out = torch.empty_like(x)
    _run(x, x, x, out, 0.0, peers, add_norm=False)
    return out


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, peers: PeerRows) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += sum over ranks of x` (the sum rounded to `x`'s dtype first, as an
    all-reduce's output would be), then `out = rms_norm(residual) * norm_weight`.

    Every rank of `peers` must make the same calls with the same shapes, in the same order.

    Args:
        x: `[rows, N]`, this rank's part, last dim contiguous; `peers.takes(x)`.
        residual: `[rows, N]`, `x`'s dtype, updated in place.
        norm_weight: `[N]`.
        peers: the ranks' mapped slots (emptied at set-up), this rank's row call counts
            and release flag.

    Returns `(out, residual)`, `out` new.
    """
    if not peers.takes(x) or residual.shape != x.shape or residual.dtype != x.dtype \
            or norm_weight.shape != (x.shape[-1],):
        raise ValueError(
            f"all_reduce_add_rms_norm takes x and residual {fitting(peers)}, and norm_weight "
            f"[N]; got x {_described(x)}, residual {_described(residual)}, norm_weight "
            f"{tuple(norm_weight.shape)}")
    require_last_dim_contiguous("residual", residual)
    out = torch.empty_like(residual)
    _run(x, residual, norm_weight, out, float(eps), peers, add_norm=True)
    return out, residual


def gathered_add_rms_norm(residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          peers: PeerRows) -> tuple[torch.Tensor, torch.Tensor]:
    """`all_reduce_add_rms_norm` of parts every rank already sent (`send_tile`, from the
    epilogue of the projection before), this rank's own among them, for the rows and width
    of `residual`: the second launch of
    `bcg.kernels.skinny_linear.projection_all_reduce_add_rms_norm`. Unchecked: that caller
    checks both before the parts are sent, the only time a refusal leaves the slots clean."""
    out = torch.empty_like(residual)
    _run(residual, residual, norm_weight, out, float(eps), peers, add_norm=True, sent=True)
    return out, residual


class PeerRows:
    """What the kernel needs of the ranks' mapped memory: for each rank the address of its
    `2 x world_size` slots of `max_rows` rows of `row_numel` elements (one slot per call
    parity and sender; `empty_slots` before the first call), this rank's row call counts,
    the flag in pinned memory that ends its waits and the device's note that a wait saw it
    (`release_ptrs` holds their addresses)."""

    def __init__(self, data_addresses: list[int], rank: int, row_numel: int, max_rows: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.rank, self.world_size = rank, len(data_addresses)
        self.row_numel, self.max_rows, self.dtype = row_numel, max_rows, dtype
        # Pinned by cudaHostAlloc (torch's default), so its address is also the device's.
        self.released = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.data_ptrs = torch.tensor(data_addresses, dtype=torch.int64, device=device)
        self.release_poll = RELEASE_POLL
        self.release_seen = torch.zeros(1, dtype=torch.int32, device=device)
        self.release_ptrs = torch.tensor(
            [self.released.data_ptr(), self.release_seen.data_ptr()], dtype=torch.int64,
            device=device)
        self.epochs = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def release_waits(self) -> None:
        """End every wait of this rank's kernels, now and in later calls (a peer died
        mid-step): the results are garbage from then on. Safe from any thread while a kernel
        waits: it writes host memory only."""
        self.released.fill_(1)

    @staticmethod
    def region_numel(world_size: int, row_numel: int, max_rows: int) -> int:
        """Elements of one rank's slots."""
        return 2 * world_size * max_rows * row_numel

    @staticmethod
    def empty_slots(slots: torch.Tensor) -> torch.Tensor:
        """`slots` (a rank's, in the buffers' dtype) emptied, as the kernel needs them
        before its first call."""
        return slots.fill_(EMPTY)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` (`[rows, N]`) fits: the buffers' dtype and device, at most `max_rows`
        rows of at most `row_numel` elements, the last dim contiguous."""
        return (x.dim() == 2 and x.dtype == self.dtype and x.device == self.epochs.device
                and 0 < x.shape[0] <= self.max_rows and 0 < x.shape[1] <= self.row_numel
                and x.stride(1) == 1)


def fitting(peers: PeerRows) -> str:
    """What `peers.takes`, in words for an error message."""
    return (f"[rows, N] of the buffers' dtype {peers.dtype}, rows at most {peers.max_rows} and "
            f"N at most {peers.row_numel}, last dim contiguous")


def _described(x: torch.Tensor) -> str:
    return f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"


def _run(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, out: torch.Tensor,
         eps: float, peers: PeerRows, add_norm: bool, sent: bool = False) -> None:
    rows, width = x.shape
    block = next_power_of_2(width)
    # At most a program per multiprocessor, each taking rows in turn: every program then runs
    # at once, so none waits for a peer's row whose program on that peer cannot start.
    programs = min(rows, multiprocessor_count(x.device))
    _launch(
        (programs,),
        (x, residual, norm_weight, out, peers.data_ptrs, peers.release_ptrs, peers.epochs),
        (eps, rows),
        {"N": width, "STRIDE_X": x.stride(0), "STRIDE_RES": residual.stride(0),
         "STRIDE_OUT": out.stride(0), "RANK": peers.rank, "WORLD": peers.world_size,
         "ROW_NUMEL": peers.row_numel, "SLOT_NUMEL": peers.row_numel * peers.max_rows,
         "EPOCH_MASK": EPOCH_MASK, "RELEASE_POLL": peers.release_poll, "ADD_NORM": add_norm,
         "SENT": sent, "BLOCK": block, "PDL": _pdl.launches_early(x.device)},
        num_warps=min(16, max(1, block // 256)),
    )


@triton.jit
def _aligned(address, dtype: tl.constexpr):
    """A buffer's address as a pointer Triton knows to be 16-byte aligned (so rows move in
    16-byte loads and stores, not element by element)."""
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)


@triton.jit(do_not_specialize=["rows"])
def _all_reduce_rows_kernel(
    x_ptr, residual_ptr, norm_w_ptr, out_ptr, data_ptrs, release_ptrs, epochs_ptr, eps, rows,
    N: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_RES: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ROW_NUMEL: tl.constexpr,
    SLOT_NUMEL: tl.constexpr,
    EPOCH_MASK: tl.constexpr,
    RELEASE_POLL: tl.constexpr,
    ADD_NORM: tl.constexpr,  # else write the sum
    SENT: tl.constexpr,  # every rank's part is already in the slots (send_tile), x unread
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        _reduce_row(x_ptr, residual_ptr, norm_w_ptr, out_ptr, data_ptrs, release_ptrs, epochs_ptr,
                    eps, row, cols, mask, N, STRIDE_X, STRIDE_RES, STRIDE_OUT, RANK, WORLD,
                    ROW_NUMEL, SLOT_NUMEL, EPOCH_MASK, RELEASE_POLL, ADD_NORM, SENT, BLOCK)


@triton.jit
def _reduce_row(x_ptr, residual_ptr, norm_w_ptr, out_ptr, data_ptrs, release_ptrs, epochs_ptr,
                eps, row, cols, mask, N: tl.constexpr, STRIDE_X: tl.constexpr,
                STRIDE_RES: tl.constexpr, STRIDE_OUT: tl.constexpr, RANK: tl.constexpr,
                WORLD: tl.constexpr, ROW_NUMEL: tl.constexpr, SLOT_NUMEL: tl.constexpr,
                EPOCH_MASK: tl.constexpr, RELEASE_POLL: tl.constexpr, ADD_NORM: tl.constexpr,
                SENT: tl.constexpr, BLOCK: tl.constexpr):
    dtype = residual_ptr.dtype.element_ty
    epoch = (tl.load(epochs_ptr + row) + 1) & EPOCH_MASK
    row_offset = (epoch & 1) * WORLD * SLOT_NUMEL + row * ROW_NUMEL  # + sender x SLOT_NUMEL
    if not SENT:
        x = _not_empty(tl.load(x_ptr + row * STRIDE_X + cols, mask=mask, other=0.0))
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                peer_data = _aligned(tl.load(data_ptrs + peer), dtype)
                tl.store(peer_data + row_offset + RANK * SLOT_NUMEL + cols, x, mask=mask)
    res_ptrs = residual_ptr + row * STRIDE_RES + cols
    if ADD_NORM:  # loaded while the parts travel: they do not depend on the peers
        residual = tl.load(res_ptrs, mask=mask, other=0.0)
        norm_weight = tl.load(norm_w_ptr + cols, mask=mask, other=0.0)
    own_data = _aligned(tl.load(data_ptrs + RANK), dtype)
    released_flag = tl.load(release_ptrs).to(tl.pointer_type(tl.int32))
    release_seen = tl.load(release_ptrs + 1).to(tl.pointer_type(tl.int32))
    released = 0
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for sender in tl.static_range(WORLD):  # rank order: the same sum on every rank
        if sender == RANK and not SENT:
            total += x.to(tl.float32)
        else:
            slot = own_data + row_offset + sender * SLOT_NUMEL + cols
            part, released = _arrived(slot, mask, cols, released, released_flag, release_seen,
                                      RELEASE_POLL)
            total += part.to(tl.float32)
            tl.store(slot, _empty_like(part), mask=mask)
    tl.store(release_seen, released, mask=released != 0)
    tl.debug_barrier()
    # Stored only once every warp has read it: each warp loads the count for itself, and one
    # that read it after the store would take the next call's slot and wait for good.
    tl.store(epochs_ptr + row, epoch)
    out_ptrs = out_ptr + row * STRIDE_OUT + cols
    if ADD_NORM:  # the sum rounded first, as the all-reduce's output would be
        add_rms_norm_loaded(total.to(dtype), residual, norm_weight, res_ptrs, out_ptrs, mask,
                            eps, N, True)
    else:
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _arrived(slot, mask, cols, released, released_flag, release_seen,
             RELEASE_POLL: tl.constexpr):
    """A sender's part of a row, read from `slot` (past the caches, the whole row: elements
    arrive in any order) until none is EMPTY or the waits are `released`: (part, released).
    Every warp must leave the loop at the same spin, so each test gives every thread one
    value: the maximum over the row's threads, or an atomic's."""
    part = tl.load(slot, mask=mask, other=0.0, volatile=True)
    spins = 0
    while (tl.max(_is_empty(part).to(tl.int32), 0) != 0) & (released == 0):
        part = tl.load(slot, mask=mask, other=0.0, volatile=True)
        spins += 1
        # The device's note on the first spin (a wait answered at once reads neither), the
        # host's flag every RELEASE_POLL.
        if spins == 1:
            released = tl.atomic_add(release_seen, 0, sem="relaxed", scope="gpu")
        if spins % RELEASE_POLL == 0:
            released = tl.max(tl.load(released_flag + cols * 0, volatile=True), 0)
    return part, released


@triton.jit
def send_tile(tile, rows, cols, row_mask, col_mask, data_ptrs, epochs_ptr, RANK: tl.constexpr,
              WORLD: tl.constexpr, ROW_NUMEL: tl.constexpr, SLOT_NUMEL: tl.constexpr,
              EPOCH_MASK: tl.constexpr):
    """Store `tile` (this rank's part of rows `rows`, columns `cols`, in the buffers' dtype)
    in every rank's slot for this rank, its own included, where the reduce after it
    (`gathered_add_rms_norm`) reads it: for a projection's epilogue, so the parts travel
    while the projection's other programs still run."""
    epoch = (tl.load(epochs_ptr + rows, mask=row_mask, other=0) + 1) & EPOCH_MASK
    offsets = ((epoch & 1) * (WORLD * SLOT_NUMEL) + RANK * SLOT_NUMEL + rows * ROW_NUMEL)[:, None] \
        + cols[None, :]
    tile = _not_empty(tile)
    for rank in tl.static_range(WORLD):
        data = _aligned(tl.load(data_ptrs + rank), tile.dtype)
        tl.store(data + offsets, tile, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _is_empty(values):
    """Which elements are negative zeros (EMPTY), by their bits (a float compare would
    take them for zeros)."""
    tl.static_assert((values.dtype.primitive_bitwidth == 16)
                     | (values.dtype.primitive_bitwidth == 32))
    if values.dtype.primitive_bitwidth == 16:
        return values.to(tl.int16, bitcast=True) == -32768
    else:
        return values.to(tl.int32, bitcast=True) == -2147483648


@triton.jit
def _empty_like(values):
    """EMPTY in `values`' shape and dtype, by its bits."""
    if values.dtype.primitive_bitwidth == 16:
        return tl.full(values.shape, -32768, tl.int16).to(values.dtype, bitcast=True)
    else:
        return tl.full(values.shape, -2147483648, tl.int32).to(values.dtype, bitcast=True)


@triton.jit
def _not_empty(values):
    """`values` with each negative zero made a positive one, so no sent element reads as
    not yet arrived."""
    return tl.where(_is_empty(values), tl.zeros_like(values), values)


_launch = CachedLauncher(_all_reduce_rows_kernel)

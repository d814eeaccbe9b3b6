"""Every decoder layer of a dense Llama-family model in one persistent launch, for a decode
step of one sequence.

At batch 1 a layer is a chain of about eight small kernels, each paying its launch and ramp
(about 3 µs on an H100) while the layer's weights take about 10 µs to read in all
(qwen3-0.6b). Here one program per multiprocessor runs every layer; the phases of a layer
are separated by grid-wide barriers (a count in global memory), and each program loads the
first weight chunk of its next phase *before* it waits, so the weights stream through the
waits. Phases of a layer (each projection cut in column tiles, at most one per program):

1. RMSNorm of the hidden state (every program computes the whole row) and the QKV projection.
2. Attention, one program per (KV head, split of the sequence): it normalises and rotates its
   query group and its key (Qwen3's per-head norms), the split holding the new position
   stores the key and value in the paged cache, and the splits merge as in decode attention.
3. The o projection, added into the hidden state (a program owns its columns).
4. RMSNorm, the gate/up projection, SiLU-and-mul.
5. The down projection, added into the hidden state.

It rounds where the per-op path does (each norm, each projection's output, each residual
sum), so tokens match it within bf16 summation order. The barriers need every program
resident at once: one program a multiprocessor, and no other kernel of ours beside it (no
tensor parallelism: its collectives would run on other streams).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels._attention_tile import LOG2_E
from bcg.kernels._launch import CachedLauncher, multiprocessor_count, next_power_of_2
from bcg.kernels.decode_attention import (
    MAX_SPLITS,
    MERGE_LOAD_VALUES,
    MIN_DOT_ROWS,
    DecodeConfig,
    DecodePlan,
    attend_split,
    plan_decode,
)

# The per-layer weights, in the order of the pointer table's columns.
WEIGHTS = ("qkv", "o", "gate_up", "down", "input_norm", "post_attention_norm", "q_norm",
           "k_norm")
# Weights a program loads at a time (the next chunk while it uses one), by projection. On
# an H100 (qwen3-0.6b), 8192 (16 KB of bf16) everywhere ran 3% faster than 16384 everywhere
# and 6% faster than 4096 (bench/results/s40); then gate/up's 16384 (24 columns padded to
# 32: 12288 read) and o's (its whole 8 x 2048 tile) 3% faster than their 8192, while QKV's
# spilled registers (bench/results/s41).
CHUNK_ELEMENTS = {"qkv": 8192, "o": 16384, "gate_up": 16384, "down": 8192}
NUM_WARPS = 8
# Past this many weights a program a phase (qwen3-0.6b's gate/up tile), the per-op path's
# kernels stream the weights as fast and the launches weigh less.
MAX_TILE_WEIGHTS = 65536
ATTENTION = DecodeConfig()  # the decode kernel's KV tile


@dataclass(frozen=True)
class StackShape:
    """What the kernel is specialised on: the model's sizes and its tiling."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    qk_norm: bool

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def unsupported_reason(shape: StackShape, programs: int) -> str | None:
    """Why the kernel cannot run `shape` on `programs` multiprocessors, or None."""
    if shape.head_dim & (shape.head_dim - 1) or shape.num_heads % shape.num_kv_heads:
        return "head_dim must be a power of two and the query heads a multiple of the KV heads"
    if shape.hidden < shape.head_dim:
        return "the hidden size must be at least head_dim (the per-head norms' stand-in)"
    for name, rows, k in _projections(shape):
        tile = _column_tile(rows, programs)
        if _tile_rows_of(name, tile) * k > MAX_TILE_WEIGHTS:
            return (f"the {name} projection ({rows} x {k}) cuts into tiles of more than "
                    f"{MAX_TILE_WEIGHTS} weights a program (a larger model: its layers run "
                    "one by one)")
        if k % 8 or rows % tile:
            return (f"the {name} projection ({rows} x {k}) does not cut into whole tiles "
                    "(its input size must be a multiple of 8)")
    return None


def _projections(shape: StackShape) -> list[tuple[str, int, int]]:
    """(name, output columns a tile is cut from, input size) of each projection."""
    return [("qkv", shape.qkv_size, shape.hidden),
            ("o", shape.hidden, shape.num_heads * shape.head_dim),
            ("gate_up", shape.intermediate, shape.hidden),
            ("down", shape.hidden, shape.intermediate)]


def _tile_rows_of(name: str, tile: int) -> int:
    """Weight rows a program reads for a tile of `tile` columns (gate and up: twice)."""
    return 2 * tile if name == "gate_up" else tile


def _column_tile(columns: int, programs: int) -> int:
    """The smallest tile that cuts `columns` into at most `programs` whole tiles: a power of
    two up to 8 columns, past that a multiple of 8 (qwen3-0.6b's 3072 gate/up columns: 128
    tiles of 24, not 96 of 32, on 132 multiprocessors), else the next power of two."""
    least = triton.cdiv(columns, programs)
    if least > 8:
        for tile in range(8 * triton.cdiv(least, 8), next_power_of_2(least), 8):
            if columns % tile == 0:
                return tile
    return next_power_of_2(least)


def _chunk_width(rows: int, k: int, elements: int) -> int:
    """The widest power-of-two slice of K that divides it and keeps a chunk of `rows`
    (padded to a power of two) within `elements` (at least 8 wide)."""
    rows, width = next_power_of_2(rows), 8
    while k % (2 * width) == 0 and rows * 2 * width <= elements:
        width *= 2
    return width


@dataclass
class StackWorkspace:
    """The buffers one launch passes between its phases, reusable by every step."""

    qkv: torch.Tensor  # [qkv_size], the QKV projection's output
    attention: torch.Tensor  # [num_heads * head_dim], attention's output
    activated: torch.Tensor  # [intermediate], SiLU(gate) * up
    barrier: torch.Tensor  # int64 [1], the arrival count (only grows)
    plan: DecodePlan  # the split attention's partials and arrival counts


def make_workspace(shape: StackShape, dtype: torch.dtype, device: torch.device) -> StackWorkspace:
    empty = [torch.empty(n, dtype=dtype, device=device) for n in
             (shape.qkv_size, shape.num_heads * shape.head_dim, shape.intermediate)]
    return StackWorkspace(*empty, torch.zeros(1, dtype=torch.int64, device=device),
                          plan_decode(1, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                      device, config=ATTENTION, num_splits=MAX_SPLITS))


def decode_stack(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    weight_table: torch.Tensor,
    kv_storage: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    workspace: StackWorkspace,
    shape: StackShape,
    eps: float,
) -> None:
    """Run every layer on `hidden` (`[1, hidden]`, the embedded token, updated in place to
    the last layer's residual sum, before the final norm).

    `positions`, `slot_mapping`, `seq_lens`, `block_tables`: the step's, row 0 is read.
    `weight_table`: int64 `[layers, len(WEIGHTS)]`, each weight's address (`WEIGHTS` order;
    gate/up is `[gate | up]` by rows, every matrix `[out, in]` contiguous). `kv_storage`:
    `KVCache.storage`, `[2, layers, blocks, block_size, kv_heads, head_dim]`. `cos`, `sin`:
    fp32 `[max_position, head_dim // 2]`. No host synchronisation: capturable.
    """
    if hidden.shape != (1, shape.hidden):
        raise ValueError(f"expected hidden [1, {shape.hidden}], got {tuple(hidden.shape)}")
    programs = multiprocessor_count(hidden.device)
    constexprs = _constexprs(shape, programs, tuple(kv_storage.shape), kv_storage.is_contiguous(),
                             cos.stride(0), workspace.plan.num_splits)
    _launch(
        (programs,),
        (hidden, positions, slot_mapping, seq_lens, block_tables, weight_table, kv_storage,
         cos, sin, workspace.qkv, workspace.attention, workspace.activated, workspace.barrier,
         workspace.plan.partial_out, workspace.plan.partial_lse, workspace.plan.arrivals),
        (eps, shape.head_dim**-0.5 * LOG2_E),
        constexprs,
        num_warps=NUM_WARPS,
        num_stages=1,
    )


@functools.lru_cache(maxsize=16)
def _constexprs(shape: StackShape, programs: int, storage_shape: tuple[int, ...],
                storage_contiguous: bool, table_stride: int, splits: int) -> dict:
    """The launch's constexprs (checked once: an engine keeps its KV cache and tables)."""
    reason = unsupported_reason(shape, programs)
    if reason is not None:
        raise ValueError(f"the fused decode stack cannot run this model: {reason}")
    _, layers, blocks, block_size, kv_heads, head_dim = storage_shape
    if not storage_contiguous or (layers, kv_heads, head_dim) != (
            shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise ValueError(f"the KV cache {storage_shape} is not a contiguous [2, "
                         f"{shape.num_layers}, blocks, block_size, {shape.num_kv_heads}, "
                         f"{shape.head_dim}] tensor")
    tiles = {}
    for name, rows, k in _projections(shape):
        tile = _column_tile(rows, programs)
        tiles[name] = (tile, _chunk_width(_tile_rows_of(name, tile), k, CHUNK_ELEMENTS[name]))
    group = shape.num_heads // shape.num_kv_heads
    kv_size = kv_heads * head_dim
    layer_stride = blocks * block_size * kv_size
    return {
        "LAYERS": shape.num_layers, "HIDDEN": shape.hidden, "HIDDEN_P2": next_power_of_2(
            shape.hidden), "NUM_HEADS": shape.num_heads, "NUM_KV_HEADS": shape.num_kv_heads,
        "HEAD_DIM": shape.head_dim, "INTERMEDIATE": shape.intermediate,
        "Q_SIZE": shape.num_heads * shape.head_dim, "KV_SIZE": kv_size,
        "QK_NORM": shape.qk_norm, "PROGRAMS": programs,
        **{f"{name.upper()}_{key}": value for name, (tile, chunk) in tiles.items()
           for key, value in (("TILE", tile), ("TILE_P2", next_power_of_2(tile)),
                              ("CHUNK", chunk))},
        "KV_LAYER_STRIDE": layer_stride, "V_OFFSET": layers * layer_stride,
        "PAGE": block_size, "CACHE_BLOCK_STRIDE": block_size * kv_size,
        "TABLE_STRIDE": table_stride,
        "SPLITS": splits, "GROUP": group, "BLOCK_H": max(MIN_DOT_ROWS, next_power_of_2(group)),
        "GROUP_P2": next_power_of_2(group), "BLOCK_N": ATTENTION.block_n,
        "MAX_SPLITS": MAX_SPLITS,
        "SPLITS_PER_LOAD": max(1, MERGE_LOAD_VALUES // (next_power_of_2(group) * shape.head_dim)),
    }


@triton.jit
def _wait_for_all(barrier_ptr, target):
    """Count this program in, then wait until the count reaches `target`."""
    tl.debug_barrier()  # every warp's stores before the one thread's release
    tl.atomic_add(barrier_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(barrier_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(barrier_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _weight(weight_table, layer, index: tl.constexpr, dtype: tl.constexpr):
    address = tl.load(weight_table + layer * 8 + index)
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)


@triton.jit
def _tile_rows(tile, TILE: tl.constexpr, TILE_P2: tl.constexpr, GATED: tl.constexpr,
               HALF_ROWS: tl.constexpr):
    """A column tile's weight rows, -1 past the tile (padded to TILE_P2 columns); gated:
    gate and up rows interleaved (`[gate | up]`)."""
    if GATED:
        j = tl.arange(0, 2 * TILE_P2)
        column = j // 2
        rows = (j % 2) * HALF_ROWS + tile * TILE + column
    else:
        column = tl.arange(0, TILE_P2)
        rows = tile * TILE + column
    return tl.where(column < TILE, rows, -1)


@triton.jit
def _weight_chunk(w_ptr, rows, start, valid, K: tl.constexpr, CHUNK: tl.constexpr):
    ks = start + tl.arange(0, CHUNK)
    return tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=valid & (rows >= 0)[:, None])


@triton.jit
def _normed(x, weight_ptrs, dtype: tl.constexpr):
    """RMSNorm's rounding: `x` (already times 1/rms) rounded, scaled, rounded (fp32 out)."""
    return _scaled(x, tl.load(weight_ptrs).to(tl.float32), dtype)


@triton.jit
def _scaled(x, weight, dtype: tl.constexpr):
    """`_normed` with its weight loaded (fp32)."""
    return (x.to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)


@triton.jit
def _inverse_rms(h_ptr, eps, HIDDEN: tl.constexpr, HIDDEN_P2: tl.constexpr):
    cols = tl.arange(0, HIDDEN_P2)
    h = tl.load(h_ptr + cols, mask=cols < HIDDEN, other=0.0, cache_modifier=".cg")
    h = h.to(tl.float32)
    return tl.rsqrt(tl.sum(h * h, 0) / HIDDEN + eps)


@triton.jit
def _project(first, w_ptr, rows, valid, x_ptr, norm_ptr, inv_rms, K: tl.constexpr,
             CHUNK: tl.constexpr, NORMED: tl.constexpr):
    """`W[rows] @ x` in fp32, `first` being the tile's first weight chunk (loaded before the
    barrier); each next chunk is loaded before the current one is used (two in flight ran
    no faster). `x` (normed by `inv_rms` and the weight at `norm_ptr` if NORMED) is read
    past the L1 cache: other programs wrote it."""
    acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
    w = first
    for c in tl.static_range(K // CHUNK):
        if c + 1 < K // CHUNK:
            w_next = _weight_chunk(w_ptr, rows, (c + 1) * CHUNK, valid, K, CHUNK)
        ks = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + ks, cache_modifier=".cg").to(tl.float32)
        if NORMED:
            x = _normed(x * inv_rms, norm_ptr + ks, x_ptr.dtype.element_ty)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        if c + 1 < K // CHUNK:
            w = w_next
    return acc


@triton.jit
def _add_into(h_ptr, cols, acc, valid):
    """The residual sum, rounded as the per-op path rounds it: `h += round(acc)`."""
    mask = valid & (cols >= 0)
    h = tl.load(h_ptr + cols, mask=mask, cache_modifier=".cg").to(tl.float32)
    total = h + acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    tl.store(h_ptr + cols, total.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotated_heads(x_ptr, heads, mask, cos, sin, norm, norm_partner, eps,
                   QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Heads `heads` at `x_ptr` (`[heads, HEAD_DIM]` rows) normalised (QK_NORM: by the
    weight `norm`, fp32 `[HEAD_DIM]`, and `norm_partner`, its halves swapped) and rotated
    (rotate-half), rounded as the rotary kernel stores them. `cos`, `sin` cover the whole
    head (each half's table repeated)."""
    dims = tl.arange(0, HEAD_DIM)
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + heads[:, None] * HEAD_DIM + dims[None, :], mask=mask[:, None],
                other=0.0, cache_modifier=".cg").to(tl.float32)
    xp = tl.load(x_ptr + heads[:, None] * HEAD_DIM + partner[None, :], mask=mask[:, None],
                 other=0.0, cache_modifier=".cg").to(tl.float32)
    if QK_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = _scaled(x * inv_rms, norm[None, :], dtype)
        xp = _scaled(xp * inv_rms, norm_partner[None, :], dtype)
    sign = tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)[None, :]
    return (x * cos[None, :] + sign * xp * sin[None, :]).to(dtype)


@triton.jit(do_not_specialize=["eps", "scale_log2"])
def _decode_stack_kernel(
    h_ptr, positions_ptr, slots_ptr, seq_lens_ptr, block_table_ptr, weight_table, kv_ptr,
    cos_ptr, sin_ptr, qkv_ptr, attn_ptr, act_ptr, barrier_ptr, partial_out_ptr,
    partial_lse_ptr, arrivals_ptr, eps, scale_log2,
    LAYERS: tl.constexpr, HIDDEN: tl.constexpr, HIDDEN_P2: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    INTERMEDIATE: tl.constexpr, Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr, PROGRAMS: tl.constexpr,
    QKV_TILE: tl.constexpr, QKV_TILE_P2: tl.constexpr, QKV_CHUNK: tl.constexpr,
    O_TILE: tl.constexpr, O_TILE_P2: tl.constexpr, O_CHUNK: tl.constexpr,
    GATE_UP_TILE: tl.constexpr, GATE_UP_TILE_P2: tl.constexpr, GATE_UP_CHUNK: tl.constexpr,
    DOWN_TILE: tl.constexpr, DOWN_TILE_P2: tl.constexpr, DOWN_CHUNK: tl.constexpr,
    KV_LAYER_STRIDE: tl.constexpr, V_OFFSET: tl.constexpr, PAGE: tl.constexpr,
    CACHE_BLOCK_STRIDE: tl.constexpr, TABLE_STRIDE: tl.constexpr,
    SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, SPLITS_PER_LOAD: tl.constexpr,
):
    dtype = h_ptr.dtype.element_ty
    pid = tl.program_id(0)
    # This launch's barriers count from the first multiple of a launch's arrivals at or
    # below the count now: no program passes the first barrier before every one read it.
    per_launch = PROGRAMS * (5 * LAYERS - 1)
    count = tl.atomic_add(barrier_ptr, 0, sem="relaxed", scope="gpu")
    target = count - count % per_launch
    qkv_rows = _tile_rows(pid, QKV_TILE, QKV_TILE_P2, False, 0)
    qkv_valid = pid * QKV_TILE < Q_SIZE + 2 * KV_SIZE
    o_rows = _tile_rows(pid, O_TILE, O_TILE_P2, False, 0)
    o_valid = pid * O_TILE < HIDDEN
    gate_up_rows = _tile_rows(pid, GATE_UP_TILE, GATE_UP_TILE_P2, True, INTERMEDIATE)
    gate_up_valid = pid * GATE_UP_TILE < INTERMEDIATE
    down_rows = _tile_rows(pid, DOWN_TILE, DOWN_TILE_P2, False, 0)
    down_valid = pid * DOWN_TILE < HIDDEN

    position = tl.load(positions_ptr)
    slot = tl.load(slots_ptr)
    seq_len = tl.load(seq_lens_ptr)
    dims = tl.arange(0, HEAD_DIM)
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + position * TABLE_STRIDE + dims % (HEAD_DIM // 2))
    sin = tl.load(sin_ptr + position * TABLE_STRIDE + dims % (HEAD_DIM // 2))
    group_rows = tl.arange(0, BLOCK_H)
    # Each split covers `chunk` positions (as attend_split cuts them); the one holding the new
    # position stores its key and value.
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N), 1) * BLOCK_N
    splits_used = tl.cdiv(seq_len, chunk)

    w_qkv = _weight(weight_table, 0, 0, dtype)
    first_qkv = _weight_chunk(w_qkv, qkv_rows, 0, qkv_valid, HIDDEN, QKV_CHUNK)
    for layer in range(LAYERS):
        # 1. input norm, QKV projection
        inv_rms = _inverse_rms(h_ptr, eps, HIDDEN, HIDDEN_P2)
        acc = _project(first_qkv, w_qkv, qkv_rows, qkv_valid, h_ptr,
                       _weight(weight_table, layer, 4, dtype), inv_rms, HIDDEN, QKV_CHUNK, True)
        tl.store(qkv_ptr + qkv_rows, acc.to(dtype), mask=qkv_valid & (qkv_rows >= 0))
        w_o = _weight(weight_table, layer, 1, dtype)
        first_o = _weight_chunk(w_o, o_rows, 0, o_valid, Q_SIZE, O_CHUNK)
        w_gate_up = _weight(weight_table, layer, 2, dtype)
        # The per-head norms' weights too: attention's first loads are then only the QKV
        # output's (a chain of two loads less on its way).
        q_norm = _weight(weight_table, layer, 6, dtype)
        k_norm = _weight(weight_table, layer, 7, dtype)
        q_scale = tl.load(q_norm + dims).to(tl.float32)
        q_scale_partner = tl.load(q_norm + partner).to(tl.float32)
        k_scale = tl.load(k_norm + dims).to(tl.float32)
        k_scale_partner = tl.load(k_norm + partner).to(tl.float32)
        target += PROGRAMS
        _wait_for_all(barrier_ptr, target)

        # 2. q/k norms and rotation, the KV store, attention: (KV head, split) items of the
        # splits in use, shared out over the programs
        k_cache = kv_ptr + layer.to(tl.int64) * KV_LAYER_STRIDE
        for item in range(pid, NUM_KV_HEADS * splits_used, PROGRAMS):
            kv_head = item // splits_used
            split = item % splits_used
            # The key and value are loaded beside the query (masked off but for the split
            # that stores them), not after it.
            stores_kv = (split == splits_used - 1) & (slot >= 0)
            k = _rotated_heads(qkv_ptr + Q_SIZE, kv_head + group_rows * 0,
                               (group_rows < 1) & stores_kv, cos, sin, k_scale,
                               k_scale_partner, eps, QK_NORM, HEAD_DIM)
            v = tl.load(qkv_ptr + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + dims,
                        mask=(dims < HEAD_DIM) & stores_kv, cache_modifier=".cg")
            q = _rotated_heads(qkv_ptr, kv_head * GROUP + group_rows, group_rows < GROUP, cos,
                               sin, q_scale, q_scale_partner, eps, QK_NORM, HEAD_DIM)
            if stores_kv:
                cache_offsets = slot * KV_SIZE + kv_head * HEAD_DIM + dims
                tl.store(k_cache + cache_offsets[None, :] + group_rows[:, None] * 0, k,
                         mask=(group_rows < 1)[:, None])
                tl.store(k_cache + V_OFFSET + cache_offsets, v)
            tl.debug_barrier()  # the new key and value, stored by every thread, then read
            attend_split(
                q, kv_head, 0, split, seq_len, k_cache, k_cache + V_OFFSET, block_table_ptr,
                attn_ptr, partial_out_ptr, partial_lse_ptr, arrivals_ptr, scale_log2, SPLITS,
                CACHE_BLOCK_STRIDE, KV_SIZE, HEAD_DIM, Q_SIZE, HEAD_DIM, NUM_HEADS, GROUP,
                BLOCK_H, HEAD_DIM, PAGE, BLOCK_N, GROUP_P2, MAX_SPLITS, SPLITS_PER_LOAD,
            )
        w_down = _weight(weight_table, layer, 3, dtype)
        target += PROGRAMS
        _wait_for_all(barrier_ptr, target)

        # 3. o projection into the residual
        acc = _project(first_o, w_o, o_rows, o_valid, attn_ptr, attn_ptr, 1.0, Q_SIZE, O_CHUNK,
                       False)
        _add_into(h_ptr, o_rows, acc, o_valid)
        first_gate_up = _weight_chunk(w_gate_up, gate_up_rows, 0, gate_up_valid, HIDDEN,
                                      GATE_UP_CHUNK)
        more = layer + 1 < LAYERS
        following = tl.minimum(layer + 1, LAYERS - 1)
        target += PROGRAMS
        _wait_for_all(barrier_ptr, target)

        # 4. post-attention norm, gate/up projection, SiLU-and-mul
        inv_rms = _inverse_rms(h_ptr, eps, HIDDEN, HIDDEN_P2)
        acc = _project(first_gate_up, w_gate_up, gate_up_rows, gate_up_valid, h_ptr,
                       _weight(weight_table, layer, 5, dtype), inv_rms, HIDDEN, GATE_UP_CHUNK,
                       True)
        gate, up = tl.split(tl.reshape(acc, [GATE_UP_TILE_P2, 2]))
        act_cols = tl.arange(0, GATE_UP_TILE_P2)
        tl.store(act_ptr + pid * GATE_UP_TILE + act_cols,
                 (gate * tl.sigmoid(gate) * up).to(dtype),
                 mask=gate_up_valid & (act_cols < GATE_UP_TILE))
        first_down = _weight_chunk(w_down, down_rows, 0, down_valid, INTERMEDIATE, DOWN_CHUNK)
        target += PROGRAMS
        _wait_for_all(barrier_ptr, target)

        # 5. down projection into the residual; the next layer's first QKV chunk
        acc = _project(first_down, w_down, down_rows, down_valid, act_ptr, act_ptr, 1.0,
                       INTERMEDIATE, DOWN_CHUNK, False)
        _add_into(h_ptr, down_rows, acc, down_valid)
        w_qkv = _weight(weight_table, following, 0, dtype)
        first_qkv = _weight_chunk(w_qkv, qkv_rows, 0, qkv_valid & more, HIDDEN, QKV_CHUNK)
        if more:
            target += PROGRAMS
            _wait_for_all(barrier_ptr, target)


_launch = CachedLauncher(_decode_stack_kernel)

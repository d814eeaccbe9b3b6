"""Fused mixture-of-experts: each token's top-k experts as two grouped GEMMs.

1. `align_to_experts` sorts the token-expert choices by expert and pads each expert's run
   to a multiple of the row tile, so every row tile belongs to one expert. It runs on the
   device with no host sync, into shapes fixed by (tokens, top-k, experts, tile): a CUDA
   graph captured for a token count serves any routing. Decode-sized steps align in one
   kernel launch, larger ones with a dozen PyTorch ops; a step of one or two tokens needs
   no alignment (a tile per choice).
2. A grouped GEMM multiplies each tile's token rows by its expert's `gate_up` weight.
3. SiLU-and-mul (`bcg.kernels.activation`; inside step 2 for decode-sized tiles).
4. The same GEMM by the expert's `down` weight, scaled by the routing weight of each choice.
5. The top-k rows of each token are summed (or left to the norm after the layer:
   `fused_expert_choices`).

Choices routed to experts of another rank (id -1, expert parallel) form one more group
whose tiles the first GEMM skips and the second fills with zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._launch import (
    CachedLauncher,
    DeviceConfigs,
    next_power_of_2,
    require_last_dim_contiguous,
)
from bcg.kernels.activation import silu_and_mul
from bcg.utils import cdiv


@dataclass(frozen=True)
class MoETiles:
    block_m: int  # rows (token-expert choices) per tile, all of one expert
    block_n: int
    block_k: int
    group_m: int  # row tiles that walk the output columns together (L2 reuse)
    num_warps: int
    num_stages: int
    # SiLU-and-mul inside the first GEMM (gate and up columns of a tile side by side, two
    # accumulators): one launch and one [choices, 2 * I] round trip fewer; the second
    # accumulator costs registers that large tiles lack.
    fuse_activation: bool = False


# Tuned on the H100 (bench/bench_moe_kernel.py --tune, Qwen3-30B-A3B's experts), by the
# mean choices per expert. Decode-sized steps route a few tokens to each expert: short row
# tiles waste little on padding and the weights stream through. Prefill steps fill larger
# tiles: 64 rows at 512 tokens (32 choices per expert), 128 rows from 2048 tokens on (13%
# faster there). The interpreter's small tiles make CPU tests cross tile edges.
DECODE_TILES = DeviceConfigs(gpu=MoETiles(16, 64, 128, 1, 4, 4, fuse_activation=True),
                             interpreter=MoETiles(16, 32, 32, 1, 4, 1, fuse_activation=True))
PREFILL_TILES = DeviceConfigs(gpu=MoETiles(64, 128, 64, 8, 4, 3),
                              interpreter=MoETiles(32, 32, 32, 2, 4, 1))
LONG_PREFILL_TILES = DeviceConfigs(gpu=MoETiles(128, 128, 64, 8, 8, 3),
                                   interpreter=MoETiles(64, 32, 32, 2, 4, 1))
DECODE_CHOICES_PER_EXPERT = 16  # up to this mean, the decode tiles
PREFILL_CHOICES_PER_EXPERT = 64  # up to this mean, the prefill tiles; above, the long ones


def moe_tiles(num_choices: int, num_experts: int, on_cuda: bool) -> MoETiles:
    if num_choices <= DECODE_CHOICES_PER_EXPERT * num_experts:
        return DECODE_TILES.for_device(on_cuda)
    if num_choices <= PREFILL_CHOICES_PER_EXPERT * num_experts:
        return PREFILL_TILES.for_device(on_cuda)
    return LONG_PREFILL_TILES.for_device(on_cuda)


def fused_experts(hidden_states: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  tiles: MoETiles | None = None) -> torch.Tensor:
    """`sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t])`, as
    `bcg.layers.moe_ref.fused_experts_ref` (same arguments; ids -1 add nothing). `tiles`
    overrides the default for the step's size (benchmarks tune with it)."""
    return _sum_choices(fused_expert_choices(hidden_states, gate_up, down, topk_weights,
                                             topk_ids, tiles))


def fused_expert_choices(hidden_states: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         tiles: MoETiles | None = None) -> torch.Tensor:
    """`fused_experts` before its sum over each token's choices: `[T, K, H]`, row `[t, k]`
    `topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t])` rounded to
    `hidden_states`' dtype (zeros for ids -1); a norm after the layer may take the sum
    (`bcg.kernels.rmsnorm.sum_add_rms_norm`)."""
    num_tokens, hidden = hidden_states.shape
    num_experts, double_intermediate, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    require_last_dim_contiguous("hidden_states", hidden_states)
    if num_tokens == 0:
        return hidden_states.new_empty(0, top_k, hidden)
    num_choices = num_tokens * top_k
    tiles = tiles or moe_tiles(num_choices, num_experts, hidden_states.is_cuda)
    alignment = align_to_experts(topk_ids, num_experts, tiles.block_m)
    weights = topk_weights.to(torch.float32).contiguous()
    if tiles.fuse_activation:
        activated = hidden_states.new_empty(num_choices, double_intermediate // 2)
        _grouped_gemm(hidden_states, gate_up.contiguous(), activated, weights, alignment,
                      tiles, rows_per_input=top_k, scale_by_weight=False, gated=True)
    else:
        gate_up_out = hidden_states.new_empty(num_choices, double_intermediate)
        _grouped_gemm(hidden_states, gate_up.contiguous(), gate_up_out, weights, alignment,
                      tiles, rows_per_input=top_k, scale_by_weight=False)
        activated = silu_and_mul(gate_up_out)
    down_out = hidden_states.new_empty(num_choices, hidden)
    _grouped_gemm(activated, down.contiguous(), down_out, weights, alignment, tiles,
                  rows_per_input=1, scale_by_weight=True)
    return down_out.view(num_tokens, top_k, hidden)


SUM_BLOCK = 256  # columns per program: a one-token step of hidden 2048 runs 8


def _sum_choices(rows: torch.Tensor) -> torch.Tensor:
    """`[T, K, H]` -> `[T, H]`, summed in fp32 and rounded once (as `rows.sum(dim=1)`, whose
    PyTorch reduction took 5 us a layer at one token on the H100)."""
    num_tokens, top_k, hidden = rows.shape
    out = rows.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out
    _launch_sum_choices(
        (num_tokens, cdiv(hidden, SUM_BLOCK)),
        (rows, out),
        (),
        {"TOP_K": top_k, "HIDDEN": hidden, "BLOCK_K": next_power_of_2(top_k),
         "BLOCK": SUM_BLOCK, "PDL": _pdl.launches_early(rows.device)},
        num_warps=2,
    )
    return out


@triton.jit
def _sum_choices_kernel(rows_ptr, out_ptr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl.start_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    total = sum_choice_rows(rows_ptr, token, cols, mask, TOP_K, HIDDEN, BLOCK_K)
    tl.store(out_ptr + token * HIDDEN + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_choice_rows(rows_ptr, token, cols, mask, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """The sum in fp32 of `token`'s TOP_K rows of `[tokens, TOP_K, HIDDEN]`
    (`fused_expert_choices`) at `cols` (`mask`: the columns in range); a kernel that ends
    the MoE layer shares it."""
    k = tl.arange(0, BLOCK_K)
    rows = tl.load(rows_ptr + (token * TOP_K + k[:, None]) * HIDDEN + cols[None, :],
                   mask=(k[:, None] < TOP_K) & mask[None, :], other=0.0)
    return tl.sum(rows.to(tl.float32), axis=0)


_launch_sum_choices = CachedLauncher(_sum_choices_kernel)


@dataclass
class ExpertAlignment:
    sorted_choices: torch.Tensor  # [capacity] int32: choice t * top_k + k, padding num_choices
    tile_experts: torch.Tensor  # [capacity / block_m] int32: expert of each row tile, or -1
    num_padded: torch.Tensor  # [1] int32: rows in use (tiles past it are empty)
    num_choices: int
    # Tile i holds choice i alone (its first row); sorted_choices and num_padded are unused.
    one_choice_per_tile: bool = False


# Steps of up to this many tokens skip the alignment: a token's top-k experts are distinct,
# so a tile per choice reads each expert's weights about once, without the sort's launch
# (H100, 30B-A3B's experts: 41 vs 46 us at 1 token, 67 vs 71 at 2; no gain at 4, a loss at 8).
ONE_CHOICE_PER_TILE_TOKENS = 2


# Up to this many choices (decode steps) one program aligns them in one launch; larger
# steps use a dozen parallel PyTorch ops, whose launches a long step amortises.
ONE_LAUNCH_ALIGN_CHOICES = 1024
ALIGN_CHUNK = 64  # most choices the one-launch kernel reads at a time


def align_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Group the choices of `topk_ids` (`[T, K]`, -1: another rank's expert) by expert in
    the order of their index, each group padded to a multiple of `block_m` rows; all on the
    device, no host sync."""
    num_choices = topk_ids.numel()
    if topk_ids.shape[0] <= ONE_CHOICE_PER_TILE_TOKENS:
        tile_experts = topk_ids.to(torch.int32).flatten()
        return ExpertAlignment(tile_experts, tile_experts, tile_experts, num_choices,
                               one_choice_per_tile=True)
    # Each non-empty group pads fewer than block_m rows and holds at least one choice.
    capacity = min(num_choices + (num_experts + 1) * (block_m - 1), num_choices * block_m)
    num_tiles = cdiv(capacity, block_m)
    if num_choices <= ONE_LAUNCH_ALIGN_CHOICES:
        return _align_in_one_launch(topk_ids, num_experts, block_m, num_tiles)
    return _align_with_torch(topk_ids, num_experts, block_m, num_tiles)


def _align_with_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                      num_tiles: int) -> ExpertAlignment:
    num_choices = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.flatten().long()
    groups = torch.where(flat < 0, num_experts, flat)  # group num_experts: skipped choices
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, groups, torch.ones_like(groups))
    padded_end = (torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
                  * block_m).cumsum(0)
    order = torch.sort(groups, stable=True).indices
    sorted_groups = groups[order]
    group_start = counts.cumsum(0) - counts
    padded_start = torch.cat([padded_end.new_zeros(1), padded_end[:-1]])
    rank_in_group = torch.arange(num_choices, device=device) - group_start[sorted_groups]
    sorted_choices = torch.full((num_tiles * block_m,), num_choices, dtype=torch.int32,
                                device=device)
    sorted_choices.scatter_(0, padded_start[sorted_groups] + rank_in_group,
                            order.to(torch.int32))
    tile_starts = torch.arange(num_tiles, device=device) * block_m
    tile_groups = torch.searchsorted(padded_end, tile_starts, right=True)
    tile_experts = torch.where(tile_groups < num_experts, tile_groups, -1).to(torch.int32)
    return ExpertAlignment(sorted_choices, tile_experts, padded_end[-1:].to(torch.int32),
                           num_choices)


def _align_in_one_launch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         num_tiles: int) -> ExpertAlignment:
    num_choices = topk_ids.numel()
    device = topk_ids.device
    alignment = ExpertAlignment(
        torch.empty(num_tiles * block_m, dtype=torch.int32, device=device),
        torch.empty(num_tiles, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
        num_choices,
    )
    _launch_align(
        (1,),
        (topk_ids.to(torch.int32).contiguous(), alignment.sorted_choices,
         alignment.tile_experts, alignment.num_padded),
        (num_choices,),
        {"NUM_EXPERTS": num_experts, "NUM_TILES": num_tiles, "BLOCK_M": block_m,
         "GROUPS": next_power_of_2(num_experts + 1),
         # A decode step's few choices in a chunk their size: its [chunk, groups] one-hot
         # sums are the kernel's work.
         "CHUNK": min(ALIGN_CHUNK, max(16, next_power_of_2(num_choices))),
         "PDL": _pdl.launches_early(device)},
        num_warps=8,
        num_stages=1,
    )
    return alignment


@triton.jit(do_not_specialize=["num_choices"])
def _align_kernel(
    topk_ids_ptr, sorted_choices_ptr, tile_experts_ptr, num_padded_ptr,
    num_choices,
    NUM_EXPERTS: tl.constexpr,
    NUM_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUPS: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: count each group (expert, then NUM_EXPERTS for skipped choices), lay the
    padded groups out, mark each tile's expert, then place each choice at its group's start
    plus its rank among the group's earlier choices."""
    _pdl.start_after_previous(PDL)
    groups = tl.arange(0, GROUPS)
    counts = tl.zeros((GROUPS,), dtype=tl.int32)
    for start in range(0, num_choices, CHUNK):
        one_hot = _choices_one_hot(topk_ids_ptr, start, num_choices, groups, NUM_EXPERTS, CHUNK)
        counts += tl.sum(one_hot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))

    for first_tile in range(0, NUM_TILES, CHUNK):
        tiles = first_tile + tl.arange(0, CHUNK)
        # A tile's group is the number of groups ending at or before its first row.
        ended = padded_end[None, :] <= tiles[:, None] * BLOCK_M
        tile_group = tl.sum(ended.to(tl.int32), axis=1)
        tl.store(tile_experts_ptr + tiles, tl.where(tile_group < NUM_EXPERTS, tile_group, -1),
                 mask=tiles < NUM_TILES)
        rows = first_tile * BLOCK_M + tl.arange(0, CHUNK * BLOCK_M)
        tl.store(sorted_choices_ptr + rows, tl.full(rows.shape, 0, tl.int32) + num_choices,
                 mask=rows < NUM_TILES * BLOCK_M)
    tl.debug_barrier()  # the padding above is written before the choices below

    placed = tl.zeros((GROUPS,), dtype=tl.int32)
    for start in range(0, num_choices, CHUNK):
        one_hot = _choices_one_hot(topk_ids_ptr, start, num_choices, groups, NUM_EXPERTS, CHUNK)
        earlier = tl.cumsum(one_hot, axis=0) - one_hot + (padded_start + placed)[None, :]
        row = tl.sum(one_hot * earlier, axis=1)
        choices = start + tl.arange(0, CHUNK)
        tl.store(sorted_choices_ptr + row, choices, mask=choices < num_choices)
        placed += tl.sum(one_hot, axis=0)


@triton.jit
def _choices_one_hot(topk_ids_ptr, start, num_choices, groups, NUM_EXPERTS: tl.constexpr,
                     CHUNK: tl.constexpr):
    """`[CHUNK, GROUPS]` int32: row i marks the group of choice `start + i` (none past the
    end)."""
    choices = start + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + choices, mask=choices < num_choices, other=0)
    group = tl.where(ids < 0, NUM_EXPERTS, ids)
    group = tl.where(choices < num_choices, group, -1)
    return (group[:, None] == groups[None, :]).to(tl.int32)


_launch_align = CachedLauncher(_align_kernel)


def _grouped_gemm(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    alignment: ExpertAlignment,
    tiles: MoETiles,
    rows_per_input: int,
    scale_by_weight: bool,
    gated: bool = False,
) -> None:
    """`out[c] = inputs[c // rows_per_input] @ weight[expert(c)].T` for every choice c
    (times its routing weight if `scale_by_weight`, zeros for skipped choices); if `gated`,
    `out` is half as wide and holds SiLU-and-mul of that product."""
    num_outputs, depth = out.shape[1], weight.shape[2]
    require_last_dim_contiguous("inputs", inputs)
    num_tiles_n = cdiv(num_outputs, tiles.block_n)
    _launch_grouped_gemm(
        (alignment.tile_experts.shape[0] * num_tiles_n,),
        (inputs, weight, out, topk_weights, alignment.sorted_choices, alignment.tile_experts,
         alignment.num_padded),
        (alignment.num_choices,),
        {"N": num_outputs, "K": depth, "STRIDE_INPUT": inputs.stride(0),
         "STRIDE_EXPERT": weight.stride(0), "STRIDE_WEIGHT_N": weight.stride(1),
         "STRIDE_OUT": out.stride(0), "ROWS_PER_INPUT": rows_per_input,
         "SCALE_BY_WEIGHT": scale_by_weight, "ZERO_SKIPPED": scale_by_weight,
         "ONE_CHOICE_PER_TILE": alignment.one_choice_per_tile,
         "GATED": gated,
         "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
         "GROUP_M": tiles.group_m, "PDL": _pdl.launches_early(out.device)},
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


@triton.jit(do_not_specialize=["num_choices"])
def _grouped_gemm_kernel(
    input_ptr, weight_ptr, out_ptr, topk_weights_ptr, sorted_choices_ptr, tile_experts_ptr,
    num_padded_ptr,
    num_choices,
    N: tl.constexpr,
    K: tl.constexpr,
    STRIDE_INPUT: tl.constexpr,
    STRIDE_EXPERT: tl.constexpr,
    STRIDE_WEIGHT_N: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    ROWS_PER_INPUT: tl.constexpr,
    SCALE_BY_WEIGHT: tl.constexpr,
    ZERO_SKIPPED: tl.constexpr,
    ONE_CHOICE_PER_TILE: tl.constexpr,
    GATED: tl.constexpr,  # weight rows [gate | up], N each: out = silu(gate) * up
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,  # launched early: wait first; the next starts after the loop
):
    _pdl.wait_for_previous(PDL)
    # Grouped launch order: GROUP_M row tiles sweep the columns together.
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles_m = tl.num_programs(0) // num_tiles_n
    group_size = GROUP_M * num_tiles_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % group_size) % rows_in_group
    tile_n = (pid % group_size) // rows_in_group
    if ONE_CHOICE_PER_TILE:
        choices = tile_m + tl.zeros((BLOCK_M,), dtype=tl.int32)
        row_mask = tl.arange(0, BLOCK_M) == 0
    else:
        if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        choices = tl.load(sorted_choices_ptr + tile_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = choices < num_choices
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    out_ptrs = out_ptr + choices.to(tl.int64)[:, None] * STRIDE_OUT + offs_n[None, :]
    out_mask = row_mask[:, None] & n_mask[None, :]
    expert = tl.load(tile_experts_ptr + tile_m).to(tl.int64)
    if expert < 0:
        if ZERO_SKIPPED:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), out_ptr.dtype.element_ty),
                     mask=out_mask)
        return

    offs_k = tl.arange(0, BLOCK_K)
    input_rows = (choices // ROWS_PER_INPUT).to(tl.int64)
    input_ptrs = input_ptr + input_rows[:, None] * STRIDE_INPUT + offs_k[None, :]
    weight_ptrs = (weight_ptr + expert * STRIDE_EXPERT
                   + offs_n.to(tl.int64)[None, :] * STRIDE_WEIGHT_N + offs_k[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED only
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a = tl.load(input_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(weight_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if GATED:
            up = tl.load(weight_ptrs + N * STRIDE_WEIGHT_N,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            up_acc = tl.dot(a, up, up_acc)
        input_ptrs += BLOCK_K
        weight_ptrs += BLOCK_K
    _pdl.launch_dependents(PDL)
    if GATED:
        acc = acc * tl.sigmoid(acc) * up_acc
    if SCALE_BY_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + choices, mask=row_mask, other=0.0)[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_launch_grouped_gemm = CachedLauncher(_grouped_gemm_kernel)

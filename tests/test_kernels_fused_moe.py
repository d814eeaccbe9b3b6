"""The fused MoE kernel against the PyTorch reference experts (fp32, on the CPU).

Without a GPU the kernel runs in Triton's interpreter in fp32 on small shapes (its small
tiles make every shape cross tile edges, and both tile configs run); the GPU tests run bf16
at the issue's sizes and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from bcg.layers.fused_moe import select_experts
from bcg.layers.moe_ref import fused_experts_ref
from tests.kernels_support import DEVICE, DTYPE, import_kernels
from tests.numerics import relative_error

fused_moe = import_kernels("fused_moe")

# fp32 in the interpreter; on CUDA bf16 inputs and outputs against the fp32 reference.
CPU_TOLERANCE, BF16_TOLERANCE = 1e-5, 2e-2


def make_case(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
              seed: int, dtype: torch.dtype = DTYPE, device: torch.device = DEVICE):
    """Tokens, experts (scaled to keep activations near 1) and a softmax routing."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    hidden_states = rand(num_tokens, hidden)
    gate_up = rand(num_experts, 2 * intermediate, hidden, scale=hidden**-0.5)
    down = rand(num_experts, hidden, intermediate, scale=intermediate**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(device)
    topk_weights, topk_ids = select_experts(logits, top_k, renormalize=True)
    return hidden_states, gate_up, down, topk_weights, topk_ids


def reference(hidden_states, gate_up, down, topk_weights, topk_ids) -> torch.Tensor:
    """The reference in fp32 on the inputs' device."""
    return fused_experts_ref(hidden_states.float(), gate_up.float(), down.float(),
                             topk_weights, topk_ids)


# (tokens, experts, top-k): one token, a few, and enough per expert for the prefill tiles
# and for the long-prefill ones.
CPU_SHAPES = [(1, 8, 2), (7, 8, 3), (13, 5, 2), (40, 4, 2), (150, 4, 2)]


@pytest.fixture(params=["one-launch", "torch"])
def align_path(request, monkeypatch):
    """Both alignments: one kernel launch (small steps) and PyTorch ops (large steps)."""
    if request.param == "torch":
        monkeypatch.setattr(fused_moe, "ONE_LAUNCH_ALIGN_CHOICES", 0)
    return request.param


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
def test_kernel_matches_reference(shape, align_path):
    case = make_case(*shape, hidden=64, intermediate=48, seed=sum(shape))
    out = fused_moe.fused_experts(*case)
    tolerance = CPU_TOLERANCE if DTYPE == torch.float32 else BF16_TOLERANCE
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    assert relative_error(out, reference(*case)) <= tolerance


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_activation_inside_the_first_gemm_matches_it_apart(num_tokens):
    """SiLU-and-mul fused into the gate/up GEMM (decode tiles) or a launch of its own."""
    case = make_case(num_tokens, 8, 3, hidden=64, intermediate=48, seed=num_tokens)
    tile_shape = (16, 32, 32, 1, 4, 1)
    fused = fused_moe.fused_experts(*case, tiles=fused_moe.MoETiles(*tile_shape, True))
    apart = fused_moe.fused_experts(*case, tiles=fused_moe.MoETiles(*tile_shape, False))
    tolerance = CPU_TOLERANCE if DTYPE == torch.float32 else BF16_TOLERANCE
    assert relative_error(fused, apart) <= tolerance
    assert relative_error(fused, reference(*case)) <= tolerance


# The rows of skipped choices between the GEMMs are never written: the interpreter may
# overflow on what memory they hold.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_experts_of_other_ranks_add_nothing(align_path):
    """Expert parallel marks another rank's experts -1: skipped, as in the reference."""
    hidden_states, gate_up, down, topk_weights, topk_ids = make_case(9, 6, 3, 64, 48, seed=3)
    topk_ids = torch.where(topk_ids >= 4, -1, topk_ids)  # this rank holds experts 0-3
    gate_up, down = gate_up[:4], down[:4]
    case = (hidden_states, gate_up, down, topk_weights, topk_ids)
    tolerance = CPU_TOLERANCE if DTYPE == torch.float32 else BF16_TOLERANCE
    assert relative_error(fused_moe.fused_experts(*case), reference(*case)) <= tolerance


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("ids", [
    [[6, 1, 3]], [[-1, 1, 3]], [[6, 1, 3], [1, 2, 6]], [[-1, 1, 3], [1, -1, -1]],
], ids=["one token", "one token, other ranks", "two tokens", "two tokens, other ranks"])
def test_few_tokens_run_a_tile_per_choice_without_alignment(monkeypatch, ids):
    """A step of one or two tokens skips the sort (a tile per choice, experts shared by the
    tokens read twice): the sums of the aligned tiles."""
    hidden_states, gate_up, down, topk_weights, _ = make_case(len(ids), 8, 3, 64, 48, seed=11)
    topk_ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    case = (hidden_states, gate_up, down, topk_weights, topk_ids)
    assert fused_moe.align_to_experts(topk_ids, 8, 16).one_choice_per_tile
    one_per_tile = fused_moe.fused_experts(*case)
    monkeypatch.setattr(fused_moe, "ONE_CHOICE_PER_TILE_TOKENS", 0)
    assert not fused_moe.align_to_experts(topk_ids, 8, 16).one_choice_per_tile
    tolerance = CPU_TOLERANCE if DTYPE == torch.float32 else BF16_TOLERANCE
    assert relative_error(one_per_tile, fused_moe.fused_experts(*case)) <= tolerance
    assert relative_error(one_per_tile, reference(*case)) <= tolerance


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_the_choices_are_what_the_kernel_sums(num_tokens):
    """`fused_expert_choices`: each token's top-k outputs, left for the norm to sum."""
    case = make_case(num_tokens, 8, 3, hidden=64, intermediate=48, seed=5)
    choices = fused_moe.fused_expert_choices(*case)
    assert choices.shape == (num_tokens, 3, 64) and choices.dtype == case[0].dtype
    assert torch.equal(fused_moe._sum_choices(choices), fused_moe.fused_experts(*case))
    assert fused_moe.fused_expert_choices(case[0][:0], *case[1:3], case[3][:0],
                                          case[4][:0]).shape == (0, 3, 64)


@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 1, 300), (3, 8, 600), (2, 3, 5)])
def test_choices_sum_as_pytorch_sums_them(num_tokens, top_k, hidden):
    rows = torch.randn(num_tokens, top_k, hidden, generator=torch.Generator().manual_seed(0))
    rows = rows.to(DEVICE, DTYPE)
    expected = rows.float().sum(dim=1)
    tolerance = CPU_TOLERANCE if DTYPE == torch.float32 else BF16_TOLERANCE
    assert relative_error(fused_moe._sum_choices(rows), expected) <= tolerance


def test_alignment_groups_every_choice_under_its_expert(align_path):
    topk_ids = torch.tensor([[2, 0], [2, -1], [1, 2], [2, 0], [-1, 1]], dtype=torch.int32)
    block_m = 4
    alignment = fused_moe.align_to_experts(topk_ids.to(DEVICE), 3, block_m)
    sorted_choices = alignment.sorted_choices.cpu()
    tile_experts = alignment.tile_experts.cpu().tolist()
    num_padded = int(alignment.num_padded)
    # Experts 0, 1, 2 and the skipped group hold 2, 2, 4, 2 choices: 4 tiles of 4 rows.
    assert num_padded == 16 and tile_experts[:4] == [0, 1, 2, -1]
    assert all(e == -1 for e in tile_experts[4:])
    flat = topk_ids.flatten().tolist()
    for tile, expert in enumerate(tile_experts[:4]):
        rows = sorted_choices[tile * block_m : (tile + 1) * block_m].tolist()
        real = [c for c in rows if c < len(flat)]
        assert all(flat[c] == (expert if expert >= 0 else -1) for c in real)
    assert sorted(c for c in sorted_choices.tolist() if c < len(flat)) == list(range(len(flat)))


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (3, 128, 8, 16), (9, 6, 3, 16), (70, 8, 2, 32), (130, 128, 8, 16),
])
def test_both_alignments_are_identical(monkeypatch, num_tokens, num_experts, top_k, block_m):
    ids = make_case(num_tokens, num_experts, top_k, 8, 8, seed=num_tokens)[4]
    ids[::5, 0] = -1  # some choices on other ranks
    one_launch = fused_moe.align_to_experts(ids, num_experts, block_m)
    monkeypatch.setattr(fused_moe, "ONE_LAUNCH_ALIGN_CHOICES", 0)
    with_torch = fused_moe.align_to_experts(ids, num_experts, block_m)
    for field in ("sorted_choices", "tile_experts", "num_padded"):
        assert torch.equal(getattr(one_launch, field), getattr(with_torch, field)), field


def test_alignment_shapes_depend_only_on_the_sizes():
    """So that a CUDA graph captured for one routing replays any other."""
    shapes = set()
    for seed in range(3):
        ids = make_case(6, 8, 2, 16, 16, seed=seed)[4]
        alignment = fused_moe.align_to_experts(ids, 8, 16)
        shapes.add((alignment.sorted_choices.shape, alignment.tile_experts.shape))
    assert len(shapes) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512, 4096])
@pytest.mark.parametrize("num_experts", [8, 128])
@pytest.mark.parametrize("top_k", [2, 8])
def test_kernel_matches_reference_bf16(num_tokens, num_experts, top_k):
    """Qwen3-30B-A3B's expert sizes (hidden 2048, moe_intermediate 768) in bf16."""
    case = make_case(num_tokens, num_experts, top_k, hidden=2048, intermediate=768,
                     seed=num_tokens + num_experts + top_k, dtype=torch.bfloat16,
                     device=torch.device("cuda"))
    out = fused_moe.fused_experts(*case)
    assert relative_error(out, reference(*case)) <= BF16_TOLERANCE


@pytest.mark.gpu
# A tile per choice, aligned in one launch, aligned by PyTorch ops.
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_kernel_replays_in_a_cuda_graph_with_new_routing(num_tokens):
    """Captured once, replayed on another routing: no host sync, no shape from the data."""
    case = make_case(num_tokens, 128, 8, 2048, 768, seed=1, dtype=torch.bfloat16,
                     device=torch.device("cuda"))
    hidden_states, gate_up, down, topk_weights, topk_ids = case
    fused_moe.fused_experts(*case)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_experts(*case)
    fresh = make_case(num_tokens, 128, 8, 2048, 768, seed=2, dtype=torch.bfloat16,
                      device=torch.device("cuda"))
    for static, new in zip(case, fresh, strict=True):
        if static is not gate_up and static is not down:
            static.copy_(new)
    graph.replay()
    assert relative_error(out, reference(*case)) <= BF16_TOLERANCE


def test_compiled_stack_calls_the_kernel_as_one_opaque_op():
    """Under torch.compile (the piecewise baseline) the kernel is traced as the op
    `bcg::fused_experts`, without a graph break."""
    from bcg.layers import triton_ops

    case = make_case(7, 8, 2, 64, 48, seed=5)
    compiled = torch.compile(triton_ops.fused_experts, backend="eager", fullgraph=True)
    tolerance = CPU_TOLERANCE if DTYPE == torch.float32 else BF16_TOLERANCE
    assert relative_error(compiled(*case), reference(*case)) <= tolerance

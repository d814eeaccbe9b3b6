"""Graph runners against the eager stack on tiny random Llama, Qwen3, Qwen3-MoE and NemotronH
models (bf16, CUDA; NemotronH's Mamba2 mixer is a second break, its state carried across steps).

Every mode must give the eager logits for batch sizes {1, 3, 8} x new tokens {1, 7, 100,
1000} after a cached prefix, and for mixed prefill + decode steps. Tolerance on the relative
error of logits (max |graph - eager| / max |eager|): 3e-2, bf16's rounding; the same kernels
run on both sides, so all but the compiled (piecewise) stack agree far closer.
"""

import sys

import pytest
import torch

from bcg.kernels._launch import CachedLauncher
from bcg.runner.graph_verify import verify_graphs
from tests.hf_tiny import VOCAB, PagedHarness, save_tiny_model
from tests.numerics import relative_error

pytestmark = pytest.mark.gpu

TOLERANCE = 3e-2
PREFIX = 5
MODES = {  # every graph mode serves both decode and prefill steps
    "eager": dict(prefill_graph="none", decode_graph="none"),
    "full+breakable": dict(prefill_graph="breakable", decode_graph="full"),
    "breakable decode": dict(prefill_graph="breakable", decode_graph="breakable"),
    "piecewise": dict(prefill_graph="piecewise", decode_graph="full"),
    "debug": dict(prefill_graph="breakable", decode_graph="full", debug_cuda_graph=True),
}
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=8192, kv_cache_tokens=20000,
              max_model_len=1100, enable_prefix_caching=False)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "nemotron_h"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path, max_position_embeddings=LIMITS["max_model_len"])
    return path


_harnesses: dict = {}


def harness(folder, mode: str, **extra) -> PagedHarness:
    key = (folder, mode, tuple(sorted(extra.items())))
    if key not in _harnesses:
        _harnesses[key] = PagedHarness(folder, device="cuda", dtype="bfloat16", block_size=16,
                                       **LIMITS, **{**MODES[mode], **extra})
    return _harnesses[key]


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def run_steps(h: PagedHarness, prompts: list[list[int]], steps: list[list[int]]):
    """Prefill `PREFIX` tokens of each prompt, then the given steps of new tokens."""
    seqs = [h.new_sequence(p) for p in prompts]
    assert all(seq.num_computed_tokens == 0 for seq in seqs)  # no prefix-cache hit
    h.step(seqs, [PREFIX] * len(seqs))
    logits = [h.step([s for s, n in zip(seqs, step, strict=True) if n], [n for n in step if n])
              for step in steps]
    for seq in seqs:
        h.block_manager.free(seq)
    return logits


def assert_same_logits(graph_steps, eager_steps, route_flips: bool = False) -> None:
    """`route_flips`: the compiled stack of an MoE model, where a token whose router nearly
    ties two experts may take the other one (the compiler's RMSNorm rounds differently from
    our kernel): that token's logits move far. Measured on an H100 (bs 1, 100 and 1000 new
    tokens): 2 of 100 and 5 of 1000 rows beyond the tolerance, median row error 0.005; and
    (2026-11-26, once each layer's projection, residual add and next norm were traced into
    one compiled graph) 1 of 7 rows at 0.034 (7 new tokens, bs 3). So there, 5% of rows, and
    at least one, may exceed it and the median row must stay within a third of it."""
    for graph_rows, eager_rows in zip(graph_steps, eager_steps, strict=True):
        for g, e in zip(graph_rows, eager_rows, strict=True):
            g, e = g.float().cpu(), e.float().cpu()
            if not route_flips:
                assert relative_error(g, e) <= TOLERANCE
                continue
            rows = (g - e).abs().amax(-1) / e.abs().amax()
            assert (rows > TOLERANCE).sum() <= max(1, 0.05 * len(rows))
            assert rows.median() <= TOLERANCE / 3


@pytest.mark.parametrize("mode", [m for m in MODES if m != "eager"])
@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("new_tokens", [1, 7, 100, 1000])
def test_mode_equals_eager(folder, mode, bs, new_tokens):
    prompts = [prompt(PREFIX + new_tokens, seed=1000 * bs + i) for i in range(bs)]
    steps = [[new_tokens] * bs]
    graph = harness(folder, mode)
    eager_before = graph.runner.forward_counts["eager"]
    route_flips = mode == "piecewise" and folder.name.startswith("qwen3_moe")
    assert_same_logits(run_steps(graph, prompts, steps),
                       run_steps(harness(folder, "eager"), prompts, steps), route_flips)
    assert graph.runner.forward_counts["eager"] == eager_before  # graphs served every step


@pytest.mark.parametrize("mode", ["full+breakable", "debug"])
def test_mixed_prefill_and_decode_steps(folder, mode):
    steps = [[60, 60, 0, 0], [1, 1, 30, 7], [1, 1, 20, 1], [1, 1, 10, 1]]  # decodes + chunks
    prompts = [prompt(PREFIX + sum(s[i] for s in steps), seed=i) for i in range(4)]
    assert_same_logits(run_steps(harness(folder, mode), prompts, steps),
                       run_steps(harness(folder, "eager"), prompts, steps))


def test_every_bucket_replays_in_random_order_like_eager(folder):
    h = harness(folder, "full+breakable")
    verify_graphs(h.runner)  # raises on any mismatch
    decode, prefill = h.runner.graph_runners
    assert (decode.kind, prefill.kind) == ("decode", "prefill")
    assert decode.pool is prefill.pool  # decode graphs reuse the prefill graphs' scratch
    assert prefill.pool_bytes > 0 and decode.capture_seconds > 0 and prefill.capture_seconds > 0


def kernel_launchers() -> list[CachedLauncher]:
    """Every kernel launcher of bcg's kernel modules (module globals: the garbage collector's
    object list misses what a start-up froze)."""
    return [value for name, module in list(sys.modules.items()) if name.startswith("bcg.kernels.")
            for value in vars(module).values() if isinstance(value, CachedLauncher)]


@pytest.mark.parametrize("mode", ["full+breakable", "breakable decode"])
def test_a_capture_that_meets_an_uncompiled_kernel_warms_up_and_captures_again(folder, mode):
    """Only the largest bucket is warmed up before capture; a capture whose kernel variant
    is not yet compiled (a capture cannot load one) is abandoned, its bucket run eagerly
    once, and captured again. Forced here by forgetting every compiled variant."""
    h = harness(folder, mode)
    for runner in h.runner.graph_runners:
        size = runner.buckets[0]
        runner.warmed_sizes.discard(size)
        for launcher in kernel_launchers():
            launcher.compiled.clear()
        runner.graphs[size] = runner._capture_warmed(size, runner.capture_inputs(size))
        assert size in runner.warmed_sizes
    verify_graphs(h.runner)  # every bucket, the recaptured ones included, equals eager


def test_decode_graphs_without_prefill_graphs_measure_their_own_pool(folder):
    h = harness(folder, "eager", decode_graph="full")
    (decode,) = h.runner.graph_runners
    assert decode.pool_bytes > 0
    steps = [[1, 1, 1]]
    prompts = [prompt(PREFIX + 1, seed=i) for i in range(3)]
    assert_same_logits(run_steps(h, prompts, steps),
                       run_steps(harness(folder, "eager"), prompts, steps))


def test_batches_beyond_the_buckets_fall_back_to_eager_and_are_counted(folder):
    h = harness(folder, "full+breakable", prefill_graph_tokens="16,64", decode_graph_bs="1,2")
    steps = [[100, 10, 10], [1, 1, 1]]
    prompts = [prompt(PREFIX + sum(s[i] for s in steps), seed=i) for i in range(3)]
    eager = harness(folder, "eager")
    counts = h.runner.forward_counts
    start = counts.copy()
    assert_same_logits(run_steps(h, prompts, steps), run_steps(eager, prompts, steps))
    delta = counts - start
    # prefix step (15 tokens) -> prefill graph; 120 tokens -> eager; 3 decodes > bs 2 -> the
    # prefill graph (16 tokens) serves them
    assert delta == {"prefill graph": 2, "eager": 1}


def test_a_one_token_prefill_graph_serves_decodes_that_store_their_keys(folder):
    """Decodes of one sequence, no decode graphs: the one-token prefill graph serves them, and
    its attention break stores their keys and values (rotary, captured on a stand-in, must
    not have taken that store over), so the next step reads them."""
    h = harness(folder, "eager", prefill_graph="breakable", prefill_graph_tokens="1,16")
    steps = [[1], [1], [1]]
    prompts = [prompt(PREFIX + len(steps), seed=11)]
    counts = h.runner.forward_counts
    start = counts.copy()
    assert_same_logits(run_steps(h, prompts, steps),
                       run_steps(harness(folder, "eager"), prompts, steps))
    assert counts - start == {"prefill graph": 1 + len(steps)}


def test_debug_mode_runs_every_op_eagerly(folder):
    h = harness(folder, "debug")
    for runner in h.runner.graph_runners:
        for captured in runner.graphs.values():
            assert captured.graph.num_segments == 0 and captured.graph.num_breaks == 1

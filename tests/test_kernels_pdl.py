"""Programmatic dependent launch (`bcg.kernels._pdl`): a chain of norms and skinny
projections, each reading what the one before wrote (and the norms updating the residual in
place); rotary storing k and v, decode attention and the o projection; and a Mamba2 decode
step (in projection, conv and state updates in place, gated norm, out projection) give bit
for bit the same launched early in a CUDA graph as launched plainly, with every output
poisoned before each replay (a kernel reading its input before the one ahead finished would
read NaN); the early variants really launch so; off the GPU, and with BCG_PDL=0, nothing
launches early."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable

import pytest
import torch

from bcg.kernels._launch import CachedLauncher
from tests.kernels_support import DEVICE, DTYPE, ON_GPU, import_kernels, make_paged_batch

pdl = import_kernels("_pdl")
decode = import_kernels("decode_attention")
mamba_conv = import_kernels("mamba_conv")
mamba_scan = import_kernels("mamba_scan")
rotary = import_kernels("rotary")
rmsnorm = import_kernels("rmsnorm")
skinny = import_kernels("skinny_linear")
fused_moe = import_kernels("fused_moe")
moe_routing = import_kernels("moe_routing")

# A wide intermediate: the kernels after a projection may start once its weight loop ends,
# so a missing wait in them would race with its epilogue; the PTX check below catches one
# whatever the timing.
HIDDEN, INTERMEDIATE, LAYERS, ROWS = (1024, 8192, 6, 3) if ON_GPU else (32, 48, 2, 3)


def test_nothing_launches_early_off_the_gpu():
    assert not pdl.launches_early(torch.device("cpu"))


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(pdl, "SWITCHED_ON", False)
    assert not pdl.launches_early(DEVICE)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("On", True), (" no ", False),
                                       ("0", False), ("false", False)])
def test_the_switch_reads_the_usual_spellings(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("BCG_PDL", raising=False)
    else:
        monkeypatch.setenv("BCG_PDL", value)
    assert pdl.switch_from_environment("BCG_PDL") is on


def test_a_bad_switch_value_is_refused_with_the_accepted_ones(monkeypatch):
    monkeypatch.setenv("BCG_PDL", "2")
    with pytest.raises(ValueError, match="BCG_PDL must be 1 or 0"):
        pdl.switch_from_environment("BCG_PDL")


def chain(x: torch.Tensor, residual: torch.Tensor, weights: list, outs: list) -> torch.Tensor:
    """Pre-norm MLP blocks: add + norm, gate/up with SiLU-and-mul, down, into `outs`."""
    for (norm_weight, gate_up, down), (normed, hidden, x_out) in zip(weights, outs, strict=True):
        rmsnorm.add_rms_norm(x, residual, norm_weight, 1e-6, out=normed)
        skinny.skinny_linear(normed, gate_up, activation="silu_and_mul", out=hidden)
        x = skinny.skinny_linear(hidden, down, out=x_out)
    return x


# A load, store or atomic on memory other kernels can see (not parameters, shared or local),
# or an asynchronous copy from it.
MEMORY_ACCESS = re.compile(r"\b(?:ld|st|atom|red)\.(?!param|shared|local)"
                           r"|\bcp\.async\.(?:ca|cg|bulk)")


def waits_before_touching_memory(ptx: str) -> bool:
    """Whether the kernel's first memory access comes after its `griddepcontrol.wait`."""
    wait = ptx.find("griddepcontrol.wait")
    return wait >= 0 and MEMORY_ACCESS.search(ptx[:wait]) is None


def launched_early(launcher) -> bool:
    """Whether `launcher` compiled a variant launched with PDL, and every such variant
    waits before its first memory access."""
    early = [compiled for compiled in launcher.compiled.values() if compiled.metadata.launch_pdl]
    return bool(early) and all(waits_before_touching_memory(c.asm["ptx"]) for c in early)


def test_the_ptx_check_finds_an_access_before_the_wait():
    assert waits_before_touching_memory("mov.u32 %r1, 0;\nld.param.u64 %rd1, [p];\n"
                                        "griddepcontrol.wait;\nld.global.b32 %r2, [%rd1];")
    assert not waits_before_touching_memory("ld.global.nc.b32 %r2, [%rd1];\n"
                                            "griddepcontrol.wait;")
    assert not waits_before_touching_memory("@%p1 atom.global.add.u32 %r1, [%rd2], 1;\n"
                                            "griddepcontrol.wait;")
    assert not waits_before_touching_memory("cp.async.cg.shared.global [%r1], [%rd3], 16;\n"
                                            "griddepcontrol.wait;")
    assert not waits_before_touching_memory("ld.param.u64 %rd1, [p];")


class RecordedLaunches:
    """A stand-in kernel for `CachedLauncher`: records each launch's keyword arguments."""

    def __init__(self) -> None:
        self.options: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.options.append(kwargs)


@pytest.mark.parametrize("waits", [False, True])
def test_the_launch_option_follows_the_pdl_constexpr(waits):
    """The `PDL` constexpr (the kernel waits for the one ahead) and the launch option come
    together: an early launch without the wait would race, a wait without it is wasted."""
    kernel = RecordedLaunches()
    CachedLauncher(kernel)((1,), (torch.zeros(1),), (), {"PDL": waits})
    assert kernel.options[0].get("launch_pdl", False) is waits


needs_pdl = pytest.mark.skipif(
    not (ON_GPU and pdl.TRITON_HAS_PDL and pdl._device_has_pdl(DEVICE)),
    reason="needs a GPU with programmatic dependent launch")


def assert_early_launches_match_plain(monkeypatch, run: Callable[[], list[torch.Tensor]],
                                      resets: list[Callable[[], None]], launchers: list) -> None:
    """`run()` (the kernels under test; returns the tensors to compare) launched plainly after
    each of `resets` (each restores one set of inputs, poisoning what outputs it reaches),
    then captured launched early in a CUDA graph and replayed, three rounds of each reset in
    turn, with the compared tensors poisoned first: every replay gives the plain launch's
    results after the same reset, bit for bit, and each of `launchers` compiled a variant
    launched early that waits first. Sets that give equal results would hide a read of the
    other set's."""
    monkeypatch.setattr(pdl, "SWITCHED_ON", False)
    expected = []
    for reset in resets:
        reset()
        expected.append([t.clone() for t in run()])
    assert not any(torch.equal(a[0], b[0]) for a, b in itertools.pairwise(expected))
    monkeypatch.setattr(pdl, "SWITCHED_ON", True)
    resets[0]()
    run()  # compiles the early-launched variants
    assert all(launched_early(launcher) for launcher in launchers)
    graph = torch.cuda.CUDAGraph()
    resets[0]()
    with torch.cuda.graph(graph):
        results = run()
    for _ in range(3):
        for reset, wanted in zip(resets, expected, strict=True):
            for tensor in results:
                tensor.fill_(float("nan"))
            reset()
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(got, want) for got, want in zip(results, wanted, strict=True))


@needs_pdl
def test_a_chain_launched_early_in_a_graph_matches_plain_launches(monkeypatch):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(DTYPE).to(DEVICE)

    weights = [(rand(HIDDEN) + 1, rand(2 * INTERMEDIATE, HIDDEN), rand(HIDDEN, INTERMEDIATE))
               for _ in range(LAYERS)]
    x, pristine = rand(ROWS, HIDDEN), rand(ROWS, HIDDEN)
    residual = pristine.clone()
    outs = [tuple(torch.empty(ROWS, width, dtype=DTYPE, device=DEVICE)
                  for width in (HIDDEN, INTERMEDIATE, HIDDEN)) for _ in range(LAYERS)]

    def reset() -> None:
        residual.copy_(pristine)
        for tensor in (t for layer in outs for t in layer):
            tensor.fill_(float("nan"))

    assert_early_launches_match_plain(
        monkeypatch, lambda: [chain(x, residual, weights, outs), residual], [reset],
        [skinny._launch, rmsnorm._launch_rms_norm])


HEADS, KV_HEADS, HEAD_DIM, PAGE = (16, 8, 128, 16) if ON_GPU else (4, 2, 16, 4)
SEQ_LENS = [300, 1000] if ON_GPU else [5, 11]


def attention_inputs(generator: torch.Generator) -> dict:
    """Two decode rows over a paged cache, their new k and v, rotary tables and an o
    projection: what a decode layer's attention part reads."""
    batch = make_paged_batch([1] * len(SEQ_LENS), SEQ_LENS, HEADS, KV_HEADS, HEAD_DIM, PAGE,
                             generator)
    positions = batch.seq_lens.long() - 1
    rows = torch.arange(len(SEQ_LENS), device=DEVICE)
    slots = batch.block_tables[rows, positions // PAGE].long() * PAGE + positions % PAGE

    def rand(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.1).to(dtype).to(DEVICE)

    return {"batch": batch, "positions": positions, "slots": slots,
            "k": rand(len(SEQ_LENS), KV_HEADS, HEAD_DIM),
            "v": rand(len(SEQ_LENS), KV_HEADS, HEAD_DIM),
            "cos": rand(max(SEQ_LENS), HEAD_DIM // 2, dtype=torch.float32),
            "sin": rand(max(SEQ_LENS), HEAD_DIM // 2, dtype=torch.float32),
            "o_weight": rand(HIDDEN, HEADS * HEAD_DIM),
            "plan": decode.plan_decode(len(SEQ_LENS), HEADS, KV_HEADS, HEAD_DIM, DEVICE)}


def attention_part(state: dict, attention_out: torch.Tensor, o_out: torch.Tensor) -> None:
    """Rotary storing the new k and v, decode attention over the cache, the o projection."""
    batch = state["batch"]
    rotary.apply_rotary(batch.q, state["k"], state["positions"], state["cos"], state["sin"],
                        kv_store=(state["v"], batch.k_cache, batch.v_cache, state["slots"]))
    decode.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.seq_lens,
                            batch.block_tables, batch.scale, out=attention_out,
                            plan=state["plan"])
    skinny.skinny_linear(attention_out.view(len(SEQ_LENS), -1), state["o_weight"], out=o_out)


def test_the_attention_part_runs_plainly():
    """The chain below, plainly (what the CPU can check of it)."""
    state = attention_inputs(torch.Generator().manual_seed(2))
    attention_out = torch.empty_like(state["batch"].q)
    o_out = torch.full((len(SEQ_LENS), HIDDEN), float("nan"), dtype=DTYPE, device=DEVICE)
    attention_part(state, attention_out, o_out)
    assert not o_out.isnan().any()


@needs_pdl
def test_rotary_attention_and_projection_launched_early_match_plain_launches(monkeypatch):
    """The rotated q and the stored k and v reach decode attention (whose splits merge in
    the last to arrive), and its output the o projection, as with plain launches."""
    state = attention_inputs(torch.Generator().manual_seed(3))
    batch = state["batch"]
    restored = (batch.q, state["k"], batch.k_cache, batch.v_cache)
    pristine = [t.clone() for t in restored]
    attention_out = torch.empty_like(batch.q)
    o_out = torch.empty(len(SEQ_LENS), HIDDEN, dtype=DTYPE, device=DEVICE)

    def reset() -> None:
        for tensor, saved in zip(restored, pristine, strict=True):
            tensor.copy_(saved)
        attention_out.fill_(float("nan"))
        o_out.fill_(float("nan"))

    def run() -> list[torch.Tensor]:
        attention_part(state, attention_out, o_out)
        return [o_out, batch.k_cache, batch.v_cache]

    assert_early_launches_match_plain(monkeypatch, run, [reset],
                                      [rotary._launch_rotary, decode._launch_split])


# NemotronH-like head shapes on the GPU; rows 0 and 2 continue from their slots' states,
# row 1 is a one-token prompt (its slot's state unread).
MAMBA = (dict(heads=32, head_dim=64, groups=2, state_size=128, taps=4) if ON_GPU
         else dict(heads=4, head_dim=8, groups=2, state_size=16, taps=4))
MAMBA_SEQ_LENS, MAMBA_SLOTS, DT_LIMIT = [9, 1, 4], [2, 0, 3], (0.0, float("inf"))


def mamba_inputs(generator: torch.Generator) -> dict:
    """One decode token per row, the mixer's weights and four state slots."""
    heads, head_dim, groups, state_size, taps = MAMBA.values()
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * state_size

    def rand(*shape: int, scale: float = 0.1, dtype: torch.dtype = DTYPE) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)

    def int_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return {"hidden": rand(ROWS, HIDDEN, scale=1.0),
            "in_weight": rand(inner + conv_dim + heads, HIDDEN),
            "conv_weight": rand(conv_dim, taps, scale=0.5), "conv_bias": rand(conv_dim),
            "A": -rand(heads, scale=1.0, dtype=torch.float32).abs() - 0.5,
            "D": rand(heads, scale=1.0, dtype=torch.float32),
            "dt_bias": rand(heads, scale=0.5, dtype=torch.float32),
            "conv_state": rand(4, taps - 1, conv_dim, scale=1.0),
            "ssm_state": rand(4, heads, head_dim, state_size, scale=1.0, dtype=torch.float32),
            "seq_lens": int_tensor(MAMBA_SEQ_LENS), "slots": int_tensor(MAMBA_SLOTS),
            "norm_weight": rand(inner) + 1, "out_weight": rand(HIDDEN, inner)}


def mamba_part(state: dict, outs: dict) -> None:
    """The mixer's decode step: in projection (z | x B C | dt), the conv update, the
    selective state update, the gated norm and the out projection."""
    heads, head_dim, groups, state_size, _ = MAMBA.values()
    inner, groups_size = heads * head_dim, groups * state_size
    skinny.skinny_linear(state["hidden"], state["in_weight"], out=outs["projected"])
    z, xbc, dt = outs["projected"].split([inner, inner + 2 * groups_size, heads], dim=-1)
    mamba_conv.causal_conv1d_update(xbc, state["conv_weight"], state["conv_bias"],
                                    state["conv_state"], state["seq_lens"], state["slots"],
                                    outs["activated"])
    x, B, C = outs["activated"].split([inner, groups_size, groups_size], dim=-1)
    mamba_scan.selective_state_update(
        x.view(ROWS, heads, head_dim), dt, state["A"], B.view(ROWS, groups, state_size),
        C.view(ROWS, groups, state_size), state["D"], state["dt_bias"], DT_LIMIT,
        state["ssm_state"], state["seq_lens"], state["slots"], outs["y"].view(ROWS, heads, -1))
    rmsnorm.gated_rms_norm(outs["y"], z, state["norm_weight"], inner // groups, 1e-5,
                           out=outs["normed"])
    skinny.skinny_linear(outs["normed"], state["out_weight"], out=outs["out"])


def mamba_outputs(state: dict) -> dict:
    widths = {"projected": state["in_weight"].shape[0], "activated": state["conv_weight"].shape[0],
              "y": state["norm_weight"].shape[0], "normed": state["norm_weight"].shape[0],
              "out": HIDDEN}
    return {name: torch.full((ROWS, width), float("nan"), dtype=DTYPE, device=DEVICE)
            for name, width in widths.items()}


def test_the_mamba_part_runs_plainly():
    """The Mamba2 chain below, plainly (what the CPU can check of it)."""
    state = mamba_inputs(torch.Generator().manual_seed(4))
    outs = mamba_outputs(state)
    mamba_part(state, outs)
    assert not outs["out"].isnan().any()


@needs_pdl
def test_a_mamba_step_launched_early_matches_plain_launches(monkeypatch):
    """Each Mamba2 kernel reads what the one before wrote (the conv and state updates also
    their slots, in place) as with plain launches."""
    state = mamba_inputs(torch.Generator().manual_seed(5))
    pristine = {name: state[name].clone() for name in ("conv_state", "ssm_state")}
    outs = mamba_outputs(state)

    def reset() -> None:
        for name, saved in pristine.items():
            state[name].copy_(saved)
        for tensor in outs.values():
            tensor.fill_(float("nan"))

    def run() -> list[torch.Tensor]:
        mamba_part(state, outs)
        return [outs["out"], state["conv_state"], state["ssm_state"]]

    assert_early_launches_match_plain(monkeypatch, run, [reset], [
        mamba_conv._launch_update, mamba_scan._launch_update, rmsnorm._launch_gated_rms_norm])


MOE = dict(experts=128, top_k=8, hidden=2048, intermediate=768) if ON_GPU else \
    dict(experts=8, top_k=2, hidden=32, intermediate=16)


def moe_inputs(num_tokens: int, generator: torch.Generator) -> dict:
    experts, _, hidden, intermediate = MOE.values()

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(DTYPE).to(DEVICE)

    return {"hidden": rand(num_tokens, hidden, scale=1.0),
            "router": rand(experts, hidden, scale=hidden**-0.5),
            "gate_up": rand(experts, 2 * intermediate, hidden, scale=hidden**-0.5),
            "down": rand(experts, hidden, intermediate, scale=intermediate**-0.5),
            "arrivals": torch.zeros(moe_routing.MAX_FUSED_ROUTER_TOKENS, dtype=torch.int32,
                                    device=DEVICE)}


def moe_part(state: dict) -> torch.Tensor:
    """The router and its top-k in one launch, then the experts: alignment (from 2 tokens
    up), the grouped GEMMs and the top-k sum."""
    weights, ids = moe_routing.route_hidden_top_k(state["hidden"], state["router"],
                                                  MOE["top_k"], True, state["arrivals"])
    return fused_moe.fused_experts(state["hidden"], state["gate_up"], state["down"], weights,
                                   ids)


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_the_moe_part_runs_plainly(num_tokens):
    assert not moe_part(moe_inputs(num_tokens, torch.Generator().manual_seed(6))).isnan().any()


@needs_pdl
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_an_moe_layer_launched_early_matches_plain_launches(monkeypatch, num_tokens):
    """Replays alternate between two sets of tokens, so a kernel reading what the one ahead
    wrote for the other set (its intermediates live in the graph's pool, which no poison
    reaches) gives the other set's answer."""
    state = moe_inputs(num_tokens, torch.Generator().manual_seed(7))
    token_sets = [state["hidden"].clone(),
                  moe_inputs(num_tokens, torch.Generator().manual_seed(8))["hidden"]]
    launchers = [moe_routing._launch_router_route, fused_moe._launch_grouped_gemm,
                 fused_moe._launch_sum_choices]
    if num_tokens > fused_moe.ONE_CHOICE_PER_TILE_TOKENS:
        launchers.append(fused_moe._launch_align)
    assert_early_launches_match_plain(
        monkeypatch, lambda: [moe_part(state)],
        [functools.partial(state["hidden"].copy_, tokens) for tokens in token_sets], launchers)

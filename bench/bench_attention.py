"""Triton paged attention against torch's varlen_attn, on Qwen3-8B-like shapes (H100).

Shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, KV block size 16.
- decode: KV bytes read per second against the HBM bandwidth this script measures (one large
  device copy, bytes read + written). Ours is timed inside a CUDA graph (as the decode runner
  uses it) and eagerly; KV block sets rotate so repeated calls never hit L2.
- extend: TFLOP/s of causal prefill without prefix, and with a cached prefix.
- host: Python-side microseconds per attention call (tiny problem, GPU never the bottleneck).
The baseline gets the same values in its own layout (contiguous K/V per sequence).

Run: python bench/bench_attention.py [--tune] [--profile-host]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, require_cuda, time_per_call_ms, write_results  # noqa: E402

from bcg.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_attention,
    plan_decode,
)
from bcg.kernels.extend_attention import ExtendConfig, extend_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
DECODE_CASES = [(1, 4096), (1, 32768), (8, 4096), (64, 4096)]  # (batch, context)
EXTEND_CASES = [(1024, 0), (4096, 0), (16384, 0), (512, 4096)]  # (new tokens, prefix)
TARGETS = {"decode_hbm_fraction_bs1_32k": 0.70, "extend_vs_varlen": 0.70, "host_us": 20.0}
L2_MULTIPLE = 4  # rotate KV sets until their footprint is this many L2 caches
SLEEP_CYCLES_PER_CALL = 300_000  # ~150 µs of GPU sleep per timed call covers its host cost


@dataclass
class PagedKV:
    """A KV pool with ``num_sets`` disjoint block tables over it, each for ``num_seqs`` rows."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[torch.Tensor]

    def contiguous(self, table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same values as ``[num_seqs * seq_len, kv_heads, head_dim]``, for the baseline."""
        k = self.k_cache[table.long()].flatten(1, 2)[:, :seq_len].flatten(0, 1)
        v = self.v_cache[table.long()].flatten(1, 2)[:, :seq_len].flatten(0, 1)
        return k.contiguous(), v.contiguous()


def make_paged_kv(num_seqs: int, seq_len: int, num_sets: int) -> PagedKV:
    blocks_per_seq = triton.cdiv(seq_len, BLOCK_SIZE)
    num_blocks = num_sets * num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    pool = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = list(pool.view(num_sets, num_seqs, blocks_per_seq).unbind(0))
    return PagedKV(k_cache, v_cache, tables)


def kv_bytes(num_seqs: int, seq_len: int) -> int:
    return 2 * num_seqs * seq_len * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def sets_to_defeat_l2(footprint: int) -> int:
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(16, triton.cdiv(L2_MULTIPLE * l2_bytes, footprint)))


def gpu_us(fn: Callable[[], object], reps: int = 30, calls: int = 1) -> float:
    """Median device time per call (µs), CUDA events around ``calls`` back-to-back calls.

    A GPU sleep queued first keeps the device busy while the host enqueues the calls, so
    host launch cost never shows up as device time.
    """
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * calls)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def graph_us(fns: list[Callable[[], object]], reps: int = 30) -> float:
    """Median device time per call of ``fns`` captured back to back in one CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return gpu_us(graph.replay, reps) / len(fns)


def host_us(calls: dict[str, Callable[[], object]], rounds: int = 15, per_round: int = 200
            ) -> dict[str, float]:
    """Median host time per call (µs) of each callable: enqueue only. Rounds interleave the
    callables, so a noisy stretch on the host hits all of them, and stay short enough that
    the GPU's launch queue never fills and blocks the host."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            samples[name].append((time.perf_counter() - start) * 1e6 / per_round)
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


def measure_hbm_gbps() -> float:
    """Device copy of 2 GiB: (bytes read + bytes written) per second, in GB/s."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = gpu_us(lambda: dst.copy_(src), reps=20) * 1e-6
    return 2 * src.nbytes / seconds / 1e9


class Baseline:
    """torch.nn.attention.varlen.varlen_attn, adapted to the keywords this torch offers;
    scaled_dot_product_attention per sequence where varlen_attn is absent."""

    def __init__(self) -> None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            self.varlen = None
            self.name = "sdpa (torch.nn.attention.varlen absent)"
            return
        self.varlen = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        self.native_gqa = "enable_gqa" in params
        self.causal_kwargs = (
            {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        )
        self.scale_kwargs = {"scale": SCALE} if "scale" in params else {}
        self.name = "varlen_attn" + ("" if self.native_gqa else " (KV heads expanded)")

    def prepare(self, q, k, v, cu_q, cu_k, max_q, max_k, causal) -> Callable[[], torch.Tensor]:
        """A zero-argument call on fixed inputs (layout work done here, not timed)."""
        if self.varlen is None:
            return self._sdpa_call(q, k, v, cu_q, cu_k, causal)
        kwargs = {**self.scale_kwargs, **(self.causal_kwargs if causal else {})}
        if self.native_gqa:
            kwargs["enable_gqa"] = True
        else:
            group = NUM_HEADS // NUM_KV_HEADS
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: self.varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    @staticmethod
    def _sdpa_call(q, k, v, cu_q, cu_k, causal) -> Callable[[], torch.Tensor]:
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        bounds = [(starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1])
                  for i in range(len(starts_q) - 1)]
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def call() -> torch.Tensor:
            return torch.cat([
                sdpa(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1),
                     is_causal=causal and b - a == d - c, scale=SCALE, enable_gqa=True
                     ).transpose(0, 1)
                for a, b, c, d in bounds
            ])

        return call


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """‖ours − theirs‖ / ‖theirs‖: both computed the same attention, so this stays ~1e-3."""
    theirs = theirs.float()
    return ((ours.float() - theirs).norm() / theirs.norm()).item()


def gbps(nbytes: float, us: float) -> float:
    return nbytes / us / 1e3


@dataclass
class DecodeInputs:
    batch: int
    context: int
    kv: PagedKV
    q: torch.Tensor
    out: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def build(cls, batch: int, context: int, shortest: int | None = None) -> DecodeInputs:
        """Every row `context` long, or (`shortest` given) lengths uniform in [shortest,
        context], as in an offline batch."""
        kv = make_paged_kv(batch, context, sets_to_defeat_l2(kv_bytes(batch, context)))
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        if shortest is not None:
            seq_lens.random_(shortest, context + 1)
        return cls(batch, context, kv, q, torch.empty_like(q), seq_lens)

    def kv_bytes(self) -> int:
        return kv_bytes(1, int(self.seq_lens.sum()))


def time_ours_decode(inputs: DecodeInputs, config: DecodeConfig | None = None,
                     num_splits: int | None = None) -> tuple[int, float, float]:
    """(splits, µs per call inside a CUDA graph, wall µs per call eagerly back to back),
    rotating KV sets."""
    plan = plan_decode(inputs.batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, "cuda", config,
                       num_splits)
    kv = inputs.kv

    def call(table: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: decode_attention(inputs.q, kv.k_cache, kv.v_cache, inputs.seq_lens,
                                        table, SCALE, out=inputs.out, plan=plan)

    calls = [call(table) for table in kv.tables]
    cycle = itertools.cycle(calls)
    eager_wall_us = time_per_call_ms(lambda: next(cycle)(), iters=20 * len(calls)) * 1e3
    in_graph = graph_us(calls)
    calls[-1]()  # leaves the last KV set's result in inputs.out for the agreement check
    return plan.num_splits, in_graph, eager_wall_us


def time_baseline_decode(inputs: DecodeInputs, baseline: Baseline) -> tuple[float, float]:
    """(µs per call, relative difference of its output from ours on the last KV set)."""
    cu_q = torch.arange(inputs.batch + 1, dtype=torch.int32, device="cuda")
    cu_k = cu_q * inputs.context
    calls = [
        baseline.prepare(inputs.q, *inputs.kv.contiguous(table, inputs.context), cu_q, cu_k,
                         1, inputs.context, False)
        for table in inputs.kv.tables
    ]
    cycle = itertools.cycle(calls)
    us = gpu_us(lambda: next(cycle)(), calls=len(calls))
    return us, rel_diff(inputs.out, calls[-1]())


def decode_row(baseline: Baseline, batch: int, context: int, hbm_gbps: float) -> dict:
    inputs = DecodeInputs.build(batch, context)
    splits, in_graph, eager = time_ours_decode(inputs)
    peer, diff = time_baseline_decode(inputs, baseline)
    nbytes = kv_bytes(batch, context)
    return {
        "batch": batch, "context": context, "num_splits": splits, "rel_diff": diff,
        "ours_graph_us": in_graph, "ours_eager_us": eager, "baseline_us": peer,
        "ours_GBps": gbps(nbytes, in_graph), "baseline_GBps": gbps(nbytes, peer),
        "ours_hbm_fraction": gbps(nbytes, in_graph) / hbm_gbps,
        "baseline_hbm_fraction": gbps(nbytes, peer) / hbm_gbps,
    }


def causal_flops(new_tokens: int, prefix: int) -> float:
    visible = new_tokens * prefix + new_tokens * (new_tokens + 1) / 2
    return 4.0 * NUM_HEADS * HEAD_DIM * visible


@dataclass
class ExtendInputs:
    new_tokens: int
    prefix: int
    kv: PagedKV
    q: torch.Tensor
    out: torch.Tensor
    cu_q: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def build(cls, new_tokens: int, prefix: int) -> ExtendInputs:
        seq_len = new_tokens + prefix
        q = torch.randn(new_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        return cls(
            new_tokens, prefix, make_paged_kv(1, seq_len, 1), q, torch.empty_like(q),
            torch.tensor([0, new_tokens], dtype=torch.int32, device="cuda"),
            torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        )

    def call_ours(self, config: ExtendConfig | None = None) -> Callable[[], torch.Tensor]:
        kv = self.kv
        return lambda: extend_attention(self.q, kv.k_cache, kv.v_cache, self.cu_q,
                                        self.seq_lens, kv.tables[0], SCALE, out=self.out,
                                        config=config)

    def call_baseline(self, baseline: Baseline) -> Callable[[], object]:
        seq_len = self.new_tokens + self.prefix
        cu_k = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
        k, v = self.kv.contiguous(self.kv.tables[0], seq_len)
        return baseline.prepare(self.q, k, v, self.cu_q, cu_k, self.new_tokens, seq_len, True)


def extend_row(baseline: Baseline, new_tokens: int, prefix: int) -> dict:
    inputs = ExtendInputs.build(new_tokens, prefix)
    ours = gpu_us(inputs.call_ours())
    peer_call = inputs.call_baseline(baseline)
    peer = gpu_us(peer_call)
    flops = causal_flops(new_tokens, prefix)
    return {
        "new_tokens": new_tokens, "prefix": prefix, "rel_diff": rel_diff(inputs.out, peer_call()),
        "ours_us": ours, "baseline_us": peer,
        "ours_TFLOPs": flops / ours / 1e6, "baseline_TFLOPs": flops / peer / 1e6,
        "ours_vs_baseline": peer / ours,
    }


@triton.jit
def _store_one_kernel(x_ptr):
    """Near-empty kernel: its host cost is Triton's own launch floor."""
    tl.store(x_ptr, 1)


def host_calls(baseline: Baseline) -> dict[str, Callable[[], object]]:
    """Attention calls on a tiny problem (one sequence of 16 tokens): the GPU idles, so
    timing them measures the host."""
    inputs = ExtendInputs.build(16, 0)
    kv, table = inputs.kv, inputs.kv.tables[0]
    decode_q, decode_out = inputs.q[:1], inputs.out[:1]

    def decode_call(num_splits: int | None) -> Callable[[], torch.Tensor]:
        plan = plan_decode(1, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, "cuda", num_splits=num_splits)
        return lambda: decode_attention(decode_q, kv.k_cache, kv.v_cache, inputs.seq_lens,
                                        table, SCALE, out=decode_out, plan=plan)

    return {
        "extend_attention": inputs.call_ours(),
        "decode_attention (splits)": decode_call(None),
        "decode_attention (1 split)": decode_call(1),
        "baseline": inputs.call_baseline(baseline),
        "triton_launch_floor": lambda: _store_one_kernel[(1,)](inputs.seq_lens),
    }


def profile_host(calls: dict[str, Callable[[], object]]) -> None:
    """cProfile of our attention calls: where their host microseconds go."""
    import cProfile
    import pstats

    for name in ("extend_attention", "decode_attention (splits)"):
        profiler = cProfile.Profile()
        profiler.runcall(lambda fn=calls[name]: [fn() for _ in range(2000)])
        torch.cuda.synchronize()
        print(f"\nprofile of 2000 calls: {name}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


DECODE_CANDIDATES = [(32, 4, 3), (64, 2, 2), (64, 4, 4), (64, 4, 2), (128, 4, 2), (128, 8, 2)]
# (batch, longest context, shortest or None for all equal)
DECODE_TUNE_CASES = [(1, 32768, None), (1, 4096, None), (1, 512, None), (8, 4096, None),
                     (64, 4096, None), (64, 2048, 100), (256, 2048, 100)]
EXTEND_CANDIDATES = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 2), (128, 64, 8, 2),
                     (64, 64, 4, 2), (64, 128, 4, 2)]


def tune(hbm_gbps: float) -> None:
    """Time candidate tile configs and split counts on the target cases; prints only."""
    rows = []
    for batch, context, shortest in DECODE_TUNE_CASES:
        inputs = DecodeInputs.build(batch, context, shortest)
        runs = [(DecodeConfig(*c), None) for c in DECODE_CANDIDATES]
        runs += [(None, splits) for splits in (16, 32, 64) if batch == 1]
        lengths = context if shortest is None else f"{shortest}-{context}"
        for config, splits in runs:
            used, in_graph, _ = time_ours_decode(inputs, config, splits)
            name = "default" if config is None else "/".join(map(str, astuple(config)))
            rows.append([name, batch, lengths, used, in_graph,
                         gbps(inputs.kv_bytes(), in_graph) / hbm_gbps])
    print_table("tune decode (block_n/warps/stages)",
                ["config", "batch", "context", "splits", "graph µs", "HBM frac"], rows)
    rows = []
    for new_tokens, prefix in ((16384, 0), (4096, 0), (1024, 0), (512, 4096)):
        inputs = ExtendInputs.build(new_tokens, prefix)
        flops = causal_flops(new_tokens, prefix)
        for candidate in EXTEND_CANDIDATES:
            us = gpu_us(inputs.call_ours(ExtendConfig(*candidate)))
            rows.append(["/".join(map(str, candidate)), new_tokens, prefix, flops / us / 1e6])
    print_table("tune extend (block_m/block_n/warps/stages)",
                ["config", "new", "prefix", "TFLOP/s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="then sweep tile configs (prints only)")
    parser.add_argument("--profile-host", action="store_true",
                        help="then profile the host side of our attention calls")
    args = parser.parse_args()
    require_cuda("bench_attention")
    torch.manual_seed(0)
    baseline = Baseline()
    hbm_gbps = measure_hbm_gbps()
    print(f"device {torch.cuda.get_device_name()}, baseline {baseline.name}, "
          f"HBM copy bandwidth {hbm_gbps:.0f} GB/s (read + write)")
    decode = [decode_row(baseline, batch, context, hbm_gbps) for batch, context in DECODE_CASES]
    extend = [extend_row(baseline, new, prefix) for new, prefix in EXTEND_CASES]
    calls = host_calls(baseline)
    host = host_us(calls)
    report(baseline, hbm_gbps, decode, extend, host)
    if args.profile_host:
        profile_host(calls)
    if args.tune:
        tune(hbm_gbps)


def report(baseline: Baseline, hbm_gbps: float, decode: list[dict], extend: list[dict],
           host: dict) -> None:
    print_table(
        f"decode: KV bytes read per second vs HBM {hbm_gbps:.0f} GB/s (ours timed in a graph)",
        ["batch", "context", "splits", "ours µs", "ours GB/s", "ours HBM", "eager wall µs",
         f"{baseline.name} µs", "its GB/s", "its HBM", "rel diff"],
        [[r["batch"], r["context"], r["num_splits"], r["ours_graph_us"], r["ours_GBps"],
          f"{r['ours_hbm_fraction']:.0%}", r["ours_eager_us"], r["baseline_us"],
          r["baseline_GBps"], f"{r['baseline_hbm_fraction']:.0%}", f"{r['rel_diff']:.1e}"]
         for r in decode],
    )
    print_table(
        "extend: causal attention of new tokens over a paged prefix",
        ["new", "prefix", "ours µs", "ours TFLOP/s", f"{baseline.name} µs", "its TFLOP/s",
         "ours/its speed", "rel diff"],
        [[r["new_tokens"], r["prefix"], r["ours_us"], r["ours_TFLOPs"], r["baseline_us"],
          r["baseline_TFLOPs"], r["ours_vs_baseline"], f"{r['rel_diff']:.1e}"] for r in extend],
    )
    print_table("host µs per attention call (Python side)", ["call", "µs"],
                [[name, value] for name, value in host.items()])
    long_decode = next(r for r in decode if (r["batch"], r["context"]) == (1, 32768))
    no_prefix = [r["ours_vs_baseline"] for r in extend if r["prefix"] == 0]
    met = {
        "decode_hbm_fraction_bs1_32k": long_decode["ours_hbm_fraction"]
        >= TARGETS["decode_hbm_fraction_bs1_32k"],
        "extend_vs_varlen": min(no_prefix) >= TARGETS["extend_vs_varlen"],
        "host_us": host["extend_attention"] <= TARGETS["host_us"],
    }
    print("\ntargets met:", met)
    write_results("bench_attention", {
        "triton": triton.__version__, "baseline": baseline.name,
        "shapes": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
        "hbm_copy_GBps": hbm_gbps, "decode": decode, "extend": extend, "host_us": host,
        "targets": TARGETS, "targets_met": met,
    })


if __name__ == "__main__":
    main()

"""Input-buffer registry: host time per `GraphBufferRegistry.fill_from` and the kernel
launches one fill issues, for an 8-slot token-axis registry on CUDA.

Target: <= 30 us host time per fill, and at most one copy launch per (dst, src) dtype
group: tail resets ride in their group's copy. Scenarios: a padded fill at a steady size,
the same with the size cycling through four values every fill (one cached fill plan
each), and a fill that needs no padding (no tail resets).
Run: python bench/bench_buffers.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, require_cuda, write_results  # noqa: E402

from bcg.graph import GraphBufferRegistry, GraphSlot, PaddingPolicy  # noqa: E402

TARGET_US = 30.0
MAX_BS = 256
MAX_NUM_TOKENS = 8192
P = PaddingPolicy
SLOTS = [  # name, dtype, policy, pad value
    ("input_ids", torch.int64, P.FOREACH_COPY, None),
    ("positions", torch.int64, P.ZERO, None),
    ("out_cache_loc", torch.int64, P.ZERO, None),
    ("token_to_seq", torch.int32, P.FILL_SENTINEL, 0),
    ("token_seq_lens", torch.int32, P.FILL_SENTINEL, 1),
    ("token_types", torch.int32, P.KEEP_PAD, None),
    ("temperatures", torch.float32, P.FILL_ONCE, 1.0),
    ("logit_scales", torch.float32, P.FOREACH_COPY, None),
]
SCENARIOS = {  # name: (raw token counts cycled through, padded token count)
    "padded, steady size": ([1000], 1024),
    "padded, size changes": ([1000, 1001, 1002, 1003], 1024),
    "no padding": ([1024], 1024),
}


@dataclass
class TokenBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    token_to_seq: torch.Tensor
    token_seq_lens: torch.Tensor
    token_types: torch.Tensor
    temperatures: torch.Tensor
    logit_scales: torch.Tensor


def make_registry() -> GraphBufferRegistry:
    registry = GraphBufferRegistry("cuda", MAX_BS, MAX_NUM_TOKENS)
    for name, dtype, policy, pad_value in SLOTS:
        slot = GraphSlot(
            name, lambda bs, tokens: (tokens,), dtype, padding_policy=policy, pad_value=pad_value
        )
        registry.register_slot(slot)
    return registry


def make_batch(num_tokens: int) -> TokenBatch:
    fields = {
        name: torch.ones(num_tokens, dtype=dtype, device="cuda") for name, dtype, _, _ in SLOTS
    }
    return TokenBatch(**fields)


def launch_bound() -> int:
    """One grouped copy launch per (dst, src) dtype group, padded or not: each tail reset
    is a copy from a pad source inside its group's launch (the sources share dtypes)."""
    return len({dtype for _, dtype, _, _ in SLOTS})


def host_us_per_fill(fills: list, iters: int, repeats: int) -> list[float]:
    """Host time per fill for each repeat; the GPU is synchronised outside the timing."""
    for fill in fills * 20:
        fill()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(iters):
            fills[i % len(fills)]()
        samples.append((time.perf_counter() - start) * 1e6 / iters)
        torch.cuda.synchronize()
    return samples


def gpu_activities(fill) -> list[str]:
    """Names of the kernels, memcpys and memsets one fill puts on the GPU."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fill()
        torch.cuda.synchronize()
    return [
        event.name
        for event in prof.events()
        if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
    ]


def bench_scenario(name: str, iters: int, repeats: int) -> dict:
    raw_counts, padded = SCENARIOS[name]
    registry = make_registry()
    fills = []
    for raw in raw_counts:
        batch = make_batch(raw)
        sizes = dict(raw_bs=1, padded_bs=1, raw_num_tokens=raw, padded_num_tokens=padded)
        fills.append(lambda batch=batch, sizes=sizes: registry.fill_from(batch, **sizes))
    samples = host_us_per_fill(fills, iters, repeats)
    activities = gpu_activities(fills[0])
    bound = launch_bound()
    host_us = statistics.median(samples)
    return {
        "scenario": name,
        "raw_num_tokens": raw_counts,
        "padded_num_tokens": padded,
        "host_us_median": host_us,
        "host_us_min": min(samples),
        "launches": len(activities),
        "launch_bound": bound,
        "gpu_activities": activities,
        "host_ok": host_us <= TARGET_US,
        "launches_ok": 0 < len(activities) <= bound,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="timed fills per repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median kept)")
    args = parser.parse_args()
    require_cuda("bench_buffers")
    rows = [bench_scenario(name, args.iters, args.repeats) for name in SCENARIOS]
    print_table(
        f"fill_from, {len(SLOTS)} token-axis slots, target <= {TARGET_US:.0f} us host",
        ["scenario", "host us", "min us", "launches", "bound", "host ok", "launches ok"],
        [
            [
                r["scenario"],
                r["host_us_median"],
                r["host_us_min"],
                r["launches"],
                r["launch_bound"],
                r["host_ok"],
                r["launches_ok"],
            ]
            for r in rows
        ],
    )
    if any(r["launches"] == 0 for r in rows):
        print("\nthe profiler saw no GPU activity (CUPTI unavailable?): launch counts unknown")
    write_results(
        "bench_buffers",
        {
            "target_host_us": TARGET_US,
            "slots": [[name, str(dtype), policy.name] for name, dtype, policy, _ in SLOTS],
            "iters": args.iters,
            "repeats": args.repeats,
            "scenarios": rows,
        },
    )


if __name__ == "__main__":
    main()

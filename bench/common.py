"""Shared helpers for the benchmarks: timing, device facts, JSON results, tables."""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bcg.config import EngineConfig
from bcg.layers.embedding import Embedding, LMHead

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def require_cuda(name: str) -> None:
    """Exit cleanly (status 0) when there is no GPU, so the script can be smoke-run."""
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA device; none found, nothing measured.")
        sys.exit(0)


def has_overlapped_steps() -> bool:
    """Whether the bcg on the path has overlapped steps (a checkout from before them, run by
    a bench with `--label before`, has no `overlap` and always runs plain steps)."""
    return "overlap" in {f.name for f in dataclasses.fields(EngineConfig)}


def synchronize() -> None:
    """Wait for the GPU's queued work; a no-op without CUDA, so that a bench's measurement
    code also runs (untimed in any useful sense) on the CPU, as its tests do."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_per_call_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Wall time per call in ms over `iters` back-to-back calls, synchronised at the ends
    only: for host-bound work this is the host cost, for GPU-bound work the GPU time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[_fmt(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def device_name() -> str:
    """The GPU's name, or the CPU's for a bench run without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU: {platform.processor() or platform.machine()}"


def merged_rows(name: str, rows: list[dict], key: Callable[[dict], tuple],
                field: str = "rows") -> list[dict]:
    """`rows` plus the entries of `field` in an earlier run's `name` JSON whose `key` no row
    of `rows` has, so the parts of a bench can be run in separate processes (a whole run
    may not fit one time slot). Only entries measured on this device are kept (a row's own
    `device`, else the file's): the file's `device` names every row's."""
    path = RESULTS_DIR / f"{name}.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    device = device_name()
    entries = earlier.get(field, [])
    same_device = [r for r in entries if r.get("device", earlier.get("device")) == device]
    if len(same_device) < len(entries):
        print(f"{path.name}: {len(entries) - len(same_device)} earlier {field} measured on "
              f"another device than {device} left out")
    fresh = {key(r) for r in rows}
    return [r for r in same_device if key(r) not in fresh] + rows


def write_results(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": device_name(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        **payload,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path


def hbm_bandwidth_gbs(num_bytes: int = 2**31) -> float:
    """Measured device memory bandwidth in GB/s: bytes read plus bytes written by a large
    device-to-device copy (a read-only stream, like a weight read, moves about as fast)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_per_call_ms(functools.partial(dst.copy_, src), iters=20)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def matmul_tflops(size: int = 8192) -> float:
    """Measured dense bf16 matmul throughput, the compute ceiling for the floors."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    ms = time_per_call_ms(functools.partial(torch.matmul, a, b), iters=20)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward reads (this rank's, under tensor parallelism): every
    parameter except an untied input embedding, of which a step gathers only a few rows."""
    head = next(m.weight for m in model.modules() if isinstance(m, LMHead))
    gathered = {id(m.weight) for m in model.modules()
                if isinstance(m, Embedding) and m.weight is not head}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in gathered)

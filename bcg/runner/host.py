"""What the host machine offers an engine running on the CPU: memory for the KV cache, and
cores (a warning when another process, or too many torch threads, fight over them).

Linux reads /proc and the cgroup files; elsewhere the memory falls back to sysconf and the
core check is skipped.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GiB = 1 << 30
# The CPU KV cache by default: at most this much (vLLM's default VLLM_CPU_KVCACHE_SPACE) ...
CPU_KV_CACHE_BYTES = 4 * GiB
# ... and at most this share of the memory available when the cache is sized.
CPU_KV_CACHE_FRACTION = 0.25
# A max_model_len the user asked for gets its cache while it fits in this share.
CPU_KV_CACHE_FRACTION_ASKED = 0.9
# Other processes keeping more than this share of our cores busy draw a warning.
BUSY_SHARE = 0.5

_cores_checked = False


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the kernel's MemAvailable, or less under a cgroup
    limit; None where neither can be read."""
    candidates = [_meminfo_available(), _cgroup_available()]
    known = [c for c in candidates if c is not None]
    if not known:
        try:
            known = [os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
        except (ValueError, OSError, AttributeError):
            return None
    return max(0, min(known))


def cpu_kv_cache_budget(asked: bool, taken: int = 0) -> tuple[int, str]:
    """Bytes the CPU caches (a hybrid's state slots, then the KV cache) may take together,
    and why: by default min(4 GiB, 25% of available memory); for a max_model_len the user
    `asked` for, 90% of available memory. `taken`: bytes of them already allocated (the
    state slots), counted back into the available memory and out of the budget returned."""
    available = available_memory_bytes()
    if available is None:
        return (max(0, CPU_KV_CACHE_BYTES - taken),
                f"{CPU_KV_CACHE_BYTES / GiB:.0f} GiB (available memory unknown)")
    available += taken
    if asked:
        budget = int(available * CPU_KV_CACHE_FRACTION_ASKED)
        why = (f"{CPU_KV_CACHE_FRACTION_ASKED:.0%} of the {available / GiB:.1f} GiB of memory "
               "available")
    else:
        budget = min(CPU_KV_CACHE_BYTES, int(available * CPU_KV_CACHE_FRACTION))
        why = (f"min({CPU_KV_CACHE_BYTES / GiB:.0f} GiB, {CPU_KV_CACHE_FRACTION:.0%} of the "
               f"{available / GiB:.1f} GiB of memory available)")
    return max(0, budget - taken), why


def warn_if_cores_contended(ranks: int = 1) -> None:
    """Log one warning, once per process, if this process's cores are oversubscribed
    (`ranks`: the tensor-parallel ranks sharing them, this one included)."""
    global _cores_checked
    if _cores_checked:
        return
    _cores_checked = True
    message = cores_contention(ranks=ranks)
    if message:
        logger.warning(message)


def cores_contention(sample_seconds: float = 0.05, ranks: int = 1) -> str | None:
    """Why the CPU steps will be slow, or None: the `ranks` tensor-parallel ranks together
    run more torch threads than this process has cores (os.sched_getaffinity), or other
    processes keep most of those cores busy (measured from /proc/stat over
    `sample_seconds`, minus this process's own CPU time and what the other ranks' threads
    may take)."""
    cores = _affinity()
    threads = torch.get_num_threads()
    problems = []
    if ranks > 1 and ranks * threads > len(cores):
        problems.append(f"tensor parallel size {ranks} runs {ranks} processes of {threads} "
                        f"torch thread{'s' if threads > 1 else ''} on {len(cores)} cores")
    elif threads > len(cores):
        problems.append(f"torch runs {threads} threads but this process may use only "
                        f"{len(cores)} cores (os.sched_getaffinity)")
    busy = _others_busy_cores(cores, sample_seconds)
    if busy is not None:
        busy -= min(busy, (ranks - 1) * threads)  # the other ranks are meant to be busy
    if busy is not None and busy > BUSY_SHARE * len(cores):
        problems.append(f"other processes keep {busy:.1f} of the {len(cores)} cores available "
                        "to this process busy")
    if not problems:
        return None
    return ("CPU cores are oversubscribed: " + "; ".join(problems) + ". Torch's threads "
            "and the other work fight over the cores and every step slows down: give each "
            "process its own cores (taskset) or fewer threads (OMP_NUM_THREADS, "
            "torch.set_num_threads)" + (", or run fewer ranks" if ranks > 1 else ""))


def _affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _others_busy_cores(cores: set[int], sample_seconds: float) -> float | None:
    """Cores' worth of CPU time that other processes used on `cores` while we slept."""
    before = _busy_ticks(cores)
    if before is None:
        return None
    own_before, wall_before = time.process_time(), time.monotonic()
    time.sleep(sample_seconds)
    after = _busy_ticks(cores)
    own = time.process_time() - own_before
    wall = time.monotonic() - wall_before
    if after is None or wall <= 0:
        return None
    busy_seconds = (after - before) / os.sysconf("SC_CLK_TCK")
    return max(0.0, busy_seconds - own) / wall


def _busy_ticks(cores: set[int]) -> int | None:
    """Non-idle clock ticks of `cores` since boot, from /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        ticks = [int(f) for f in fields]
        # user nice system idle iowait irq softirq steal [guest guest_nice: inside user]
        total += sum(ticks[:8]) - ticks[3] - ticks[4]
    return total


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """The cgroup's memory limit minus its use, page cache it can drop not counted (v2, then
    v1); None without a limit."""
    for folder, limit_name, usage_name, inactive_key in (
        ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
         "total_inactive_file"),
    ):
        try:
            limit = Path(folder, limit_name).read_text().strip()
            usage = int(Path(folder, usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit"
            return None
        return int(limit) - max(0, usage - _cgroup_stat(Path(folder, "memory.stat"), inactive_key))
    return None


def _cgroup_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0

"""The GPU kernels of a torch.profiler chrome trace that ran over 5 ms, with the three
before them on the same stream, and the kernel names by total time."""
import collections
import json
import sys

for path in sys.argv[1:]:
    events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                      and "dur" in e), key=lambda e: e["ts"])
    long = [i for i, e in enumerate(kernels) if e["dur"] > 5000]
    print(f"== {path}: {len(kernels)} kernels, {len(long)} over 5 ms")
    for i in long[:10]:
        e = kernels[i]
        print(f"  {e['ts'] / 1e3:.3f} ms  {e['dur'] / 1e3:.3f} ms  {e['name'][:100]}  stream "
              f"{e.get('args', {}).get('stream')}")
        for p in kernels[max(0, i - 3):i]:
            print(f"     before {p['ts'] / 1e3:.3f} {p['dur'] / 1e3:.3f} {p['name'][:80]} stream "
                  f"{p.get('args', {}).get('stream')}")
    totals = collections.Counter()
    for e in kernels:
        totals[e["name"][:70]] += e["dur"]
    for name, t in totals.most_common(6):
        print(f"  total {t / 1e3:9.1f} ms  {name}")

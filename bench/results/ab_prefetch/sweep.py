"""L2 prefetch sweep (session 26): decode engine step time at batch 1 and 8 with each skinny
projection pulling the head of the next projection's weight into L2, per setting.
Run: python bench/results/ab_prefetch/sweep.py MODEL "mb,mode,start" ..."""
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_decode import measure  # noqa: E402

import bcg.kernels.skinny_linear as sk  # noqa: E402
from bcg.engine.llm import LLM  # noqa: E402


def check_equal() -> None:
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    nxt = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ref = sk.skinny_linear(x, w)
    for mode in (1, 2, 3):
        for start in (False, True):
            sk.PREFETCH_MODE, sk.PREFETCH_AT_START = mode, start
            got = sk.skinny_linear(x, w, prefetch=nxt.reshape(-1).view(torch.uint8)[: 8 << 20])
            torch.cuda.synchronize()
            print("mode", mode, "start", start, "equal", torch.equal(got, ref), flush=True)


def main() -> None:
    model = sys.argv[1]
    check_equal()
    for setting in sys.argv[2:]:
        mb, mode, start = setting.split(",")
        os.environ["BCG_PREFETCH_MB"] = mb
        sk.PREFETCH_MODE, sk.PREFETCH_AT_START = int(mode), start == "1"
        llm = LLM(model=model, load_format="dummy", max_model_len=1024,
                  gpu_memory_utilization=0.6, decode_graph_bs="1,8", prefill_graph="none")
        times = [measure(llm.engine, batch) * 1e3 for batch in (1, 8, 1, 8)]
        print(f"RESULT {model} mb={mb} mode={mode} start={start} "
              f"b1 {times[0]:.3f} {times[2]:.3f} b8 {times[1]:.3f} {times[3]:.3f}", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        time.sleep(0.5)


if __name__ == "__main__":
    main()

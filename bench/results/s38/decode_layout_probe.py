"""Does decode attention stream the KV cache faster with each page stored head-major?

Issue 18's offline qwen3-8b run spends 7.0 of its 17.5 kernel seconds in decode attention,
at about 83% of the H100's nominal HBM bandwidth. The cache is [blocks, page, kv_heads,
head_dim] (NHD): a (row, KV head) program reads 256-byte pieces 2 KiB apart. Stored as
[blocks, kv_heads, page, head_dim] (HND) and viewed back as NHD, the same kernel (it takes
strides) reads each page's head as one contiguous run. This probe times both layouts at
qwen3-8b's heads (32 q / 8 KV, head_dim 128, bf16), offline-like batches (160 rows, lengths
uniform in [100, 2048]; and 160 rows of 1024), pages of 16 and 64 tokens, blocks scattered,
in a CUDA graph, each at the split count the engine picks for 160 rows and at 2, 4 and 8
(each row cut into up to that many chunks of whole 128-token tiles: the load balance across
a mixed batch, not the layout, may be what costs); prints GB/s of KV read beside the HBM
bandwidth a 2 GiB copy measures, and checks the layouts give the same output.
Run: python bench/results/s38/decode_layout_probe.py   (one GPU, about a minute)
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from bcg.kernels.decode_attention import decode_attention, plan_decode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import hbm_bandwidth_gbs, time_per_call_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ROWS = 32, 8, 128, 160
CALLS, REPLAYS = 10, 20


def lengths(kind: str, generator: torch.Generator) -> list[int]:
    if kind == "mixed":  # longest first, as the scheduler orders a step's decodes
        return sorted(torch.randint(100, 2049, (ROWS,), generator=generator).tolist(),
                      reverse=True)
    return [1024] * ROWS


def caches(seq_lens: list[int], page: int, head_major: bool, generator: torch.Generator):
    """k, v caches viewed as [blocks, page, kv_heads, head_dim] (head-major storage if asked,
    same values) and scattered block tables."""
    per_row = max(-(-n // page) for n in seq_lens)
    num_blocks = ROWS * per_row
    order = torch.randperm(num_blocks, generator=generator)
    tables = order.view(ROWS, per_row).to(torch.int32).cuda()
    shape = (num_blocks, page, KV_HEADS, HEAD_DIM)
    k, v = (torch.randn(shape, generator=generator).to(torch.bfloat16).cuda() for _ in range(2))
    if head_major:
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    return k, v, tables


def time_ms(fn) -> float:
    """GPU time of one call of `fn`, from replays of a graph of `CALLS` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return time_per_call_ms(graph.replay, iters=REPLAYS) / CALLS


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: a 2 GiB copy moves {hbm_bandwidth_gbs():.0f} GB/s "
          f"(read + write)")
    default_splits = plan_decode(ROWS, HEADS, KV_HEADS, HEAD_DIM, "cuda").num_splits
    print(f"{'lengths':>8} {'page':>5} {'layout':>6} {'splits':>6} {'ms':>8} {'GB/s':>7}  "
          f"same as token-major")
    for kind in ("mixed", "uniform"):
        seq_lens = lengths(kind, generator)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        q = torch.randn(ROWS, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16).cuda()
        kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * 2
        outputs: dict[tuple[bool, int], torch.Tensor] = {}
        for page in (16, 64):
            for head_major in (False, True):
                k, v, tables = caches(seq_lens, page, head_major,
                                      torch.Generator().manual_seed(page))
                layout = "HND" if head_major else "NHD"
                for splits in sorted({default_splits, 2, 4, 8}):
                    plan = plan_decode(ROWS, HEADS, KV_HEADS, HEAD_DIM, "cuda",
                                       num_splits=splits)
                    out = torch.empty_like(q)
                    ms = time_ms(functools.partial(decode_attention, q, k, v, lens, tables,
                                                   HEAD_DIM**-0.5, out=out, plan=plan))
                    outputs[(head_major, splits)] = out
                    same = "" if not head_major else \
                        str(torch.equal(out, outputs[(False, splits)]))
                    print(f"{kind:>8} {page:>5} {layout:>6} {splits:>6} {ms:8.4f} "
                          f"{kv_bytes / ms / 1e6:7.0f}  {same}")
                del k, v


if __name__ == "__main__":
    main()

"""Row kernels vs grouped GEMMs (30b experts) in CUDA graphs; row-kernel tune at 1 and 2 tokens."""
import sys
sys.path.insert(0, "bench")
import bench_moe_kernel as b
from bcg.kernels import fused_moe as fm
from common import print_table
rows = b.measure("30b", [1, 2, 4, 8])
rows += b.measure("30b", [1, 2, 4, 8], dict.fromkeys([1, 2, 4, 8], fm.DECODE_TILES.gpu))
rows += b.measure("30b", [1, 2, 4, 8], dict.fromkeys([1, 2, 4, 8], fm.ROW_KERNEL_TILES.gpu))
for shape in ("235b-tp8", "235b-ep8"):
    rows += b.measure(shape, [1, 2], dict.fromkeys([1, 2], fm.DECODE_TILES.gpu))
    rows += b.measure(shape, [1, 2], dict.fromkeys([1, 2], fm.ROW_KERNEL_TILES.gpu))
print_table("row vs grouped", ["shape", "tokens", "kernels", "us", "weight GB/s"],
            [[r["shape"], r["tokens"], r["kernels"], r["ms"] * 1e3, r["weight_gbs"]] for r in rows])
b.TOKENS = [1]
best = b.tune("30b")
print({k: str(v) for k, v in best.items()})

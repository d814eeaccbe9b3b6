"""Compile the all-reduce kernel for sm_90 on a machine without a GPU and write its PTX
(/tmp/arn_WORLD.ptx), to read how the waits' reads are lowered.
TRITON_INTERPRET=0 python bench/results/s34/compile_all_reduce_ptx.py WORLD"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, ".")
from bcg.kernels import all_reduce_norm as m
k = m._all_reduce_rows_kernel
sig = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "norm_w_ptr": "*bf16", "out_ptr": "*bf16",
       "data_ptrs": "*i64", "release_ptrs": "*i64", "epochs_ptr": "*i32", "eps": "fp32", "rows": "i32"}
consts = {"N": 4096, "STRIDE_X": 4096, "STRIDE_RES": 4096, "STRIDE_OUT": 4096, "RANK": 0,
          "WORLD": int(sys.argv[1]), "ROW_NUMEL": 8192, "SLOT_NUMEL": 8192 * 256, "EPOCH_MASK": m.EPOCH_MASK,
          "RELEASE_POLL": m.RELEASE_POLL, "ADD_NORM": True, "BLOCK": 4096}
for name in consts: sig[name] = "constexpr"
src = ASTSource(fn=k, signature=sig, constexprs=consts)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
ptx = c.asm["ptx"]
print("compiled; bar.sync count", ptx.count("bar.sync"), "atom", ptx.count("atom."), "lines", len(ptx.splitlines()))
open(f"/tmp/arn_{sys.argv[1]}.ptx", "w").write(ptx)

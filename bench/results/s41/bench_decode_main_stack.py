"""bench_decode.py as main runs it: main's fused decode stack
(bench/results/s41/decode_stack_main.py, written before the call by `git show
25fa87a:bcg/kernels/decode_stack.py`) in place of the working tree's and PyTorch's argmax
for greedy sampling, to time the two side by side in one call.
python bench/results/s41/bench_decode_main_stack.py [bench_decode arguments]"""
import runpy, sys
sys.path[:0] = [".", "bench", "bench/results/s41"]
import decode_stack_main
import bcg.layers.triton_ops as triton_ops
triton_ops.decode_stack = decode_stack_main.decode_stack
triton_ops.make_decode_stack_workspace = decode_stack_main.make_workspace
triton_ops.decode_stack_unsupported = decode_stack_main.unsupported_reason
triton_ops.argmax_rows = lambda logits: logits.argmax(dim=-1)
sys.argv = ["bench/bench_decode.py"] + sys.argv[1:]
runpy.run_path("bench/bench_decode.py", run_name="__main__")

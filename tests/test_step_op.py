"""`step_op` on the CPU: the engine's modules import without the compiler, and once
`prepare_for_compile` ran, a compiled function runs each step op's body outside its graph,
for the ops made before and after that call alike."""

import subprocess
import sys

import torch

from bcg.layers.step_op import prepare_for_compile, step_op


def test_the_runner_imports_without_the_compiler():
    """torch._dynamo is 1.7 s of a process's start: only a piecewise engine needs it."""
    code = "import sys, bcg.runner.model_runner; print('torch._dynamo' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.split()[-1]
    assert imported == "False"


def doubling_op(seen: list[bool]):
    def body(layer, x: torch.Tensor, out: torch.Tensor) -> None:
        seen.append(torch.compiler.is_compiling())
        out.copy_(x * 2)

    return step_op(body)


def run_compiled(op) -> torch.Tensor:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        op(None, x + 1, out)
        return out + 1

    try:
        return torch.compile(forward, backend="eager")(torch.arange(4.0))
    finally:
        torch.compiler.reset()


def test_a_compiled_function_runs_the_body_outside_its_graph():
    seen_before, seen_after = [], []
    made_before = doubling_op(seen_before)
    prepare_for_compile()
    made_after = doubling_op(seen_after)
    for op, seen in ((made_before, seen_before), (made_after, seen_after)):
        assert run_compiled(op).tolist() == [3.0, 5.0, 7.0, 9.0]
        assert seen == [False]  # run, not traced

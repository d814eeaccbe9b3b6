"""Ops that read per-step state (attention; next the Mamba2 mixer): the one place that
decides how such an op runs inside a captured graph or a compiled stack.

`step_op(body)` wraps `body(layer, *tensors) -> None`, which reads the live batch from the
forward context and writes its result into an output tensor among its arguments (the
with-output style, so a graph break copies nothing back). The returned op is
- a graph break while a breakable graph is captured: each replay runs `body` eagerly;
- the edge of the compiled region inside a `torch.compile`d stack (the piecewise split);
- a plain call otherwise (eager steps, and full decode graphs, which capture `body` itself).
It takes the layer, not a layer index: the compiler would specialise on the integer and
recompile the caller once per layer (hitting its recompile limit on deep models).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bcg.graph import eager_on_graph, is_in_breakable_cuda_graph

StepBody = Callable[..., None]


def step_op(body: StepBody) -> StepBody:
    as_break = eager_on_graph(body)

    def call(*args) -> None:
        if torch.compiler.is_compiling():
            outside_compile(*args)
        elif is_in_breakable_cuda_graph():
            as_break(*args)
        else:
            body(*args)

    @torch.compiler.disable
    def outside_compile(*args) -> None:
        call(*args)  # at run time, not compiling: a break or a plain call

    return call

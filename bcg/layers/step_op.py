"""Ops that read per-step state (attention, the Mamba2 mixer, the all-to-all expert
exchange): the one place that decides how such an op runs inside a captured graph or a
compiled stack.

`step_op(body)` wraps `body(layer, *tensors) -> None`, which reads the live batch from the
forward context and writes its result into an output tensor among its arguments (the
with-output style, so a graph break copies nothing back). The returned op is
- a graph break while a breakable graph is captured: each replay runs `body` eagerly;
- the edge of the compiled region inside a `torch.compile`d stack (the piecewise split);
- a plain call otherwise (eager steps, and full decode graphs, which capture `body` itself).
It takes the layer, not a layer index: the compiler would specialise on the integer and
recompile the caller once per layer (hitting its recompile limit on deep models).

The edges are made by `prepare_for_compile()`, which code that compiles a stack calls first:
making one (`torch.compiler.disable`) imports the compiler, 1.7 s of a process's start that
engines without piecewise graphs, and every tensor-parallel worker of one, never use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from bcg.graph import eager_on_graph, is_in_breakable_cuda_graph

StepBody = Callable[..., None]

_edge_makers: list[Callable[[], None]] = []  # one per op, run by prepare_for_compile
_compile_ready = False  # once prepared, later ops get their edge at once
_preparing = threading.Lock()  # no op may be seen as ready before its edge exists


def step_op(body: StepBody) -> StepBody:
    as_break = eager_on_graph(body)
    outside_compile: StepBody | None = None
    unprepared = (f"{body.__qualname__} is traced by torch.compile before its edge exists: call "
                  "bcg.layers.step_op.prepare_for_compile() before compiling a stack")

    def call(*args) -> None:
        if torch.compiler.is_compiling():
            if outside_compile is None:
                # without fullgraph Dynamo breaks the graph here and traces `body` whole
                raise RuntimeError(unprepared)
            outside_compile(*args)
        elif is_in_breakable_cuda_graph():
            as_break(*args)
        else:
            body(*args)

    def make_edge() -> None:
        nonlocal outside_compile

        @torch.compiler.disable
        def run_outside(*args) -> None:
            call(*args)  # at run time, not compiling: a break or a plain call

        outside_compile = run_outside

    with _preparing:
        _edge_makers.append(make_edge)
        if _compile_ready:
            make_edge()
    return call


def prepare_for_compile() -> None:
    """Give every step op its compiled region's edge (once per process). Code that compiles
    a stack calls it first: an op traced before it has no edge, and Dynamo then traces its
    body into the compiled region."""
    global _compile_ready
    with _preparing:
        if not _compile_ready:
            for make_edge in _edge_makers:
                make_edge()
            _compile_ready = True

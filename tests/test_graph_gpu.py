"""GPU tests of bcg.graph: real CUDA graph segments with eager breaks."""

import dataclasses
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from bcg.graph import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    GraphReplayError,
    break_graph,
    current_capture,
    driver_launch,
    eager_on_graph,
    fork_stream,
    get_current_replay_token,
    get_current_stream,
    mark_break_output,
)

pytestmark = pytest.mark.gpu

# Live per-step state read by break bodies, the way attention reads the forward context.
LIVE = {"shift": 0.0}


@eager_on_graph
def shifted_softmax_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.softmax(x + LIVE["shift"], dim=-1))


def layer(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ weight)
    attn = torch.empty_like(h)  # allocated inside the segment: lives in the graph pool
    shifted_softmax_into(h, attn)
    return x + attn * 2.0  # the residual x crosses the break


def stack(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    for weight in weights:
        x = layer(x, weight)
    return x


@pytest.fixture(autouse=True, scope="module")
def cublas_ready():
    """Create the cuBLAS handle before any capture: creating it inside one fails, as with
    any graph capture, which a warm-up run normally takes care of."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    torch.cuda.synchronize()


def make_weights(layers: int, width: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(width, width, device="cuda", generator=gen) * 0.1 for _ in range(layers)]


def capture(fn, *args, graph=None, **capture_kwargs):
    graph = graph or BreakableCUDAGraph()
    torch.cuda.synchronize()
    with BreakableCUDAGraphCapture(graph, **capture_kwargs):
        out = fn(*args)
    torch.cuda.synchronize()
    return graph, out


def test_no_break():
    x = torch.randn(8, 16, device="cuda")
    graph, out = capture(lambda: (x * 2).sin())
    assert (graph.num_segments, graph.num_breaks) == (1, 0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, (x * 2).sin())


@pytest.mark.parametrize("layers", [1, 4])
def test_breaks_with_temporaries_and_repeated_replays(layers):
    weights = make_weights(layers)
    x = torch.randn(32, 64, device="cuda")
    graph, out = capture(stack, x, weights)
    assert (graph.num_segments, graph.num_breaks) == (layers + 1, layers)
    for step in range(5):
        LIVE["shift"] = float(step)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, stack(x, weights))
    LIVE["shift"] = 0.0


def driver_launches(graph: BreakableCUDAGraph) -> int:
    """How many of the replay's steps launch a segment through the CUDA driver."""
    return sum(getattr(step, "func", None) is driver_launch._driver.cuGraphLaunch
               for step in graph._replay_steps())


@pytest.mark.skipif(driver_launch._driver is None, reason="the CUDA driver is not reachable")
def test_segments_launch_through_the_driver_except_random_ones_on_any_stream():
    weights = make_weights(2)
    x = torch.randn(32, 64, device="cuda")
    noise = torch.empty(1024, device="cuda")

    def random_then_stack():
        noise.copy_(torch.rand_like(noise))  # segment 0 draws random numbers
        return stack(x, weights)

    graph, out = capture(random_then_stack)
    draws = []
    for stream in [torch.cuda.current_stream(), torch.cuda.current_stream(),
                   torch.cuda.Stream(), torch.cuda.current_stream()]:
        x.copy_(torch.randn_like(x))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.replay()
        torch.cuda.current_stream().wait_stream(stream)
        torch.testing.assert_close(out, stack(x, weights))
        draws.append(noise.clone())
    assert graph._random_segments == {0}
    assert driver_launches(graph) == graph.num_segments - 1
    assert len({tuple(draw[:8].tolist()) for draw in draws}) == len(draws)  # fresh draws


def test_decorator_disabled_and_outside_capture():
    calls = []

    @eager_on_graph(enable=False)
    def inline(x):
        calls.append("inline")
        return x + 1

    x = torch.zeros(4, device="cuda")
    assert shifted_softmax_into(x, torch.empty_like(x)) is None  # plain call outside capture
    graph, out = capture(lambda: inline(x) * 3)
    assert graph.num_breaks == 0 and calls == ["inline"]
    x.fill_(1.0)
    graph.replay()  # inline was captured into the graph: it does not run again in Python
    assert calls == ["inline"] and out.tolist() == [6.0] * 4


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class Holder:
    t: torch.Tensor
    note: str


RETURN_KINDS = {
    "tensor": (lambda x: x * 2, lambda r: r),
    "tuple": (lambda x: (x * 2, x + 1), lambda r: r[0] + r[1]),
    "list": (lambda x: [x * 2, x + 1], lambda r: r[0] + r[1]),
    "namedtuple": (lambda x: Pair(x * 2, x + 1), lambda r: r.a + r.b),
    "dict": (lambda x: {"a": x * 2, "b": x + 1}, lambda r: r["a"] + r["b"]),
    "dataclass": (lambda x: Holder(x * 2, "n"), lambda r: r.t),
}


@pytest.mark.parametrize("kind", sorted(RETURN_KINDS))
def test_returning_breaks_are_copied_back(kind):
    produce, consume = RETURN_KINDS[kind]
    body = eager_on_graph(produce)
    x = torch.randn(16, device="cuda")

    def region():
        result = body(x.sin())
        return consume(result).cos()

    graph, out = capture(region)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, consume(produce(x.sin())).cos())


def test_break_graph_nested_break_stub_and_barrier():
    log, barriers = [], []

    @eager_on_graph
    def inner(t):
        log.append("inner")
        t.add_(1)

    def stub(t):
        log.append("stub")

    @eager_on_graph(capture_stub=stub)
    def outer(t):
        log.append("outer")
        inner(t)

    x = torch.zeros(4, device="cuda")

    def region():
        y = x * 1
        break_graph()
        outer(y)
        return y * 2

    graph, out = capture(region, barrier_fn=lambda: barriers.append(1))
    assert graph.num_breaks == 2 and barriers == [1, 1] and log == ["stub"]
    graph.replay()
    torch.cuda.synchronize()
    assert log == ["stub", "outer", "inner"] and barriers == [1, 1]
    assert out.tolist() == [2.0] * 4


def test_empty_segments_first_between_and_last():
    x = torch.ones(4, device="cuda")
    out = torch.empty_like(x)

    def region():
        break_graph()
        break_graph()
        shifted_softmax_into(x, out)
        y = out * 4
        break_graph()
        return y

    graph, y = capture(region)
    assert (graph.num_segments, graph.num_breaks) == (1, 4)
    second, z = capture(lambda: x * 3, pool=graph.pool())  # the pool is still usable
    x.fill_(2.0)
    graph.replay()
    second.replay()
    assert y.tolist() == [1.0] * 4 and z.tolist() == [6.0] * 4
    graph.reset()
    second.replay()


def test_exception_during_capture_then_fresh_capture():
    @eager_on_graph
    def boom(t):
        raise RuntimeError("break failed at capture")

    x = torch.ones(4, device="cuda")
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="break failed"), BreakableCUDAGraphCapture(graph):
        boom(x * 2)
    assert current_capture() is None and not torch.cuda.is_current_stream_capturing()
    graph, out = capture(lambda: x * 5, graph=graph)
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == [10.0] * 4


def test_exception_during_replay_names_the_break():
    armed = [False]

    @eager_on_graph
    def fragile(t):
        if armed[0]:
            raise ValueError("stale metadata")

    x = torch.ones(4, device="cuda")
    graph, _ = capture(lambda: fragile(x * 2))
    armed[0] = True
    with pytest.raises(GraphReplayError, match=r"break 0 \(.*fragile\).*stale metadata"):
        graph.replay()


@pytest.mark.parametrize("fork", [fork_stream,
                                  lambda side: side.wait_stream(torch.cuda.current_stream())],
                         ids=["fork_stream", "plain wait_stream"])
def test_side_stream_forked_inside_a_segment(fork):
    side = torch.cuda.Stream()
    x = torch.randn(256, 256, device="cuda")
    out_main, out_side = torch.empty_like(x), torch.empty_like(x)

    def region():
        fork(side)
        with torch.cuda.stream(side):
            out_side.copy_(x @ x)  # spans the break below
        shifted_softmax_into(x, out_main)
        torch.cuda.current_stream().wait_stream(side)
        return out_main + out_side

    graph, out = capture(region)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, torch.softmax(x, -1) + x @ x)


def test_a_stream_forked_through_an_event_and_left_unjoined_is_named():
    side = torch.cuda.Stream()
    x = torch.randn(64, 64, device="cuda")

    def region():
        event = torch.cuda.current_stream().record_event()
        side.wait_event(event)  # a fork bcg cannot see
        with torch.cuda.stream(side):
            x.mul_(2)
        shifted_softmax_into(x, torch.empty_like(x))

    with pytest.raises(RuntimeError, match="could not end.*through an event"):
        capture(region)
    torch.cuda.synchronize()
    torch.randn(4, device="cuda")  # the failed capture left the generators usable


def test_leak_check_catches_a_break_that_keeps_memory_and_accepts_a_marked_one():
    kept = []

    @eager_on_graph
    def leaky(x):
        kept.append(x * 2)  # allocated in the break, alive after it, not returned

    @eager_on_graph
    def marked(x):
        kept.append(x * 3)
        mark_break_output(kept[-1])

    x = torch.randn(1024, device="cuda")
    with pytest.raises(RuntimeError, match="(?s)leaky leaked 1 CUDA allocation.*4096 bytes"):
        with BreakableCUDAGraphCapture(BreakableCUDAGraph(), check_leaks=True):
            leaky(x)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, check_leaks=True):
        marked(x)
    assert graph.num_breaks == 1


REFUSAL_CHECK = """
import torch
from bcg.graph import BreakableCUDAGraph, BreakableCUDAGraphCapture
torch.cuda.memory._record_memory_history(max_entries=1000)
torch.empty(16, device="cuda")
try:
    with BreakableCUDAGraphCapture(BreakableCUDAGraph(), check_leaks=True):
        pass
except RuntimeError as error:
    print("REFUSED" if "already being recorded" in str(error) else error)
"""


def test_leak_check_refuses_when_history_is_already_recorded():
    # A process of its own: recording, once on, stays on (bcg's and this test's).
    done = subprocess.run([sys.executable, "-c", REFUSAL_CHECK], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.strip() == "REFUSED", done.stdout + done.stderr


def test_decreasing_sizes_largest_first_in_one_pool_random_replay():
    """The hazard that made a peer return wrong tokens: smaller captures reusing the
    pool blocks of larger ones. Every graph must still equal eager."""
    weights = make_weights(3)
    sizes = [512, 256, 128, 64, 32, 16, 8, 1]
    graphs, inputs, outputs = {}, {}, {}
    pool = None
    for size in sizes:
        inputs[size] = torch.randn(size, 64, device="cuda")
        graph = BreakableCUDAGraph()
        graphs[size], outputs[size] = capture(stack, inputs[size], weights, graph=graph, pool=pool)
        pool = graph.pool()
    order = sizes * 3
    random.Random(0).shuffle(order)
    for size in order:
        LIVE["shift"] = random.random()
        inputs[size].copy_(torch.randn_like(inputs[size]))
        graphs[size].replay()
        torch.testing.assert_close(outputs[size], stack(inputs[size], weights))
    LIVE["shift"] = 0.0


def test_replay_token_changes_per_replay_and_stream_is_the_replay_stream():
    seen = []

    @eager_on_graph
    def record(t):
        seen.append((get_current_replay_token(), get_current_stream()))

    x = torch.ones(2, device="cuda")
    graph, _ = capture(lambda: (record(x + 1), record(x + 2)))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.replay()
        graph.replay()
    tokens = [token for token, _ in seen[2:]]
    assert tokens[0] == tokens[1] != tokens[2] == tokens[3]
    assert all(s == stream for _, s in seen[2:])


def test_captures_in_two_threads_are_isolated():
    errors = []

    def worker():
        try:
            x = torch.ones(4, device="cuda")
            graph, out = capture(lambda: shifted_softmax_into(x, x) or x * 8)
            graph.replay()
            torch.cuda.synchronize()
            assert out.tolist() == [2.0] * 4
        except Exception as error:  # surfaced in the main thread
            errors.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors

"""CPU tests of bcg.graph: copy_output, decorator forms, flag scoping, and the capture
protocol driven by a fake CUDA backend (tests/fake_cuda.py)."""

import dataclasses
import enum
import gc
import threading
import types
import weakref
from typing import NamedTuple

import pytest
import torch

import bcg.graph.capture as capture_module
from bcg.graph import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    GraphReplayError,
    break_graph,
    copy_output,
    current_capture,
    eager_on_graph,
    enable_breakable_cuda_graph,
    fork_stream,
    get_current_replay_token,
    is_in_breakable_cuda_graph,
    mark_break_output,
)
from bcg.graph.context import _current_stream
from bcg.graph.copy_output import tensors_in
from tests.fake_cuda import FakeBackend, FakeStream


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    count: int


class Plain:
    def __init__(self, hidden, tag):
        self.hidden, self.tag = hidden, tag


# ---------------------------------------------------------------- copy_output


def test_copy_output_tensor_in_place():
    dst, src = torch.zeros(3), torch.arange(3.0)
    assert copy_output(dst, src) is dst
    assert torch.equal(dst, src)


def test_copy_output_same_tensor_is_untouched():
    dst = torch.arange(3.0)
    assert copy_output(dst, dst) is dst


def test_copy_output_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"shape mismatch.*\(3,\).*\(4,\)"):
        copy_output(torch.zeros(3), torch.zeros(4))


def test_copy_output_tensor_replaced_by_other_type_is_an_error():
    with pytest.raises(TypeError, match="same structure"):
        copy_output(torch.zeros(3), 5)


def test_copy_output_tuple_and_list():
    d1, d2 = torch.zeros(2), torch.zeros(2)
    out = copy_output((d1, d2), (torch.ones(2), torch.full((2,), 2.0)))
    assert type(out) is tuple and out[0] is d1 and out[1] is d2
    assert d2.tolist() == [2.0, 2.0]
    lst = [torch.zeros(1), 7]
    result = copy_output(lst, [torch.ones(1), 8])
    assert result is lst and lst[0].item() == 1.0 and lst[1] == 8


def test_copy_output_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 elements"):
        copy_output((torch.zeros(1), torch.zeros(1)), (torch.zeros(1),))


def test_copy_output_namedtuple_keeps_type():
    dst = Pair(torch.zeros(2), torch.zeros(2))
    out = copy_output(dst, Pair(torch.ones(2), torch.ones(2) * 3))
    assert isinstance(out, Pair) and out.a is dst.a and out.b.tolist() == [3.0, 3.0]


def test_copy_output_dict():
    dst = {"x": torch.zeros(2), "n": 1}
    out = copy_output(dst, {"x": torch.ones(2), "n": 2})
    assert out is dst and dst["x"].tolist() == [1.0, 1.0] and dst["n"] == 2
    with pytest.raises(ValueError, match="keys"):
        copy_output({"x": torch.zeros(1)}, {"y": torch.zeros(1)})


def test_copy_output_dataclass_and_object():
    logits = torch.zeros(2, 2)
    dst = Output(logits, 1)
    out = copy_output(dst, Output(torch.ones(2, 2), 5))
    assert out is dst and dst.logits is logits and logits.sum() == 4 and dst.count == 5
    hidden = torch.zeros(3)
    plain = Plain(hidden, "a")
    copy_output(plain, Plain(torch.ones(3), "b"))
    assert plain.hidden is hidden and hidden.sum() == 3 and plain.tag == "b"


def test_copy_output_nested_and_fallback():
    inner = torch.zeros(2)
    dst = {"pair": (inner, [torch.zeros(1)])}
    copy_output(dst, {"pair": (torch.ones(2), [torch.ones(1)])})
    assert inner.sum() == 2 and dst["pair"][1][0].item() == 1
    assert copy_output(3, 4) == 4
    assert copy_output(None, "x") == "x"


# ---------------------------------------------------------------- decorator forms


def test_decorator_forms_outside_capture_are_plain_calls():
    @eager_on_graph
    def bare(x):
        return x + 1

    @eager_on_graph()
    def configured(x):
        return x + 2

    @eager_on_graph(True)
    def positional(x):
        return x + 3

    assert (bare(1), configured(1), positional(1)) == (2, 3, 4)
    assert bare.__name__ == "bare" and bare.__wrapped__ is not None


def test_disabled_decorator_returns_function_unchanged():
    def fn(x):
        return x

    assert eager_on_graph(enable=False)(fn) is fn
    assert eager_on_graph(False)(fn) is fn


# ---------------------------------------------------------------- flags


def test_enable_flag_scoping_and_exception_restore():
    assert not is_in_breakable_cuda_graph()
    with enable_breakable_cuda_graph():
        assert is_in_breakable_cuda_graph()
        with enable_breakable_cuda_graph(False):
            assert not is_in_breakable_cuda_graph()
        assert is_in_breakable_cuda_graph()
    with pytest.raises(KeyError), enable_breakable_cuda_graph():
        raise KeyError
    assert not is_in_breakable_cuda_graph()


def test_enable_flag_is_per_thread():
    seen = []
    with enable_breakable_cuda_graph():
        thread = threading.Thread(target=lambda: seen.append(is_in_breakable_cuda_graph()))
        thread.start()
        thread.join()
        assert is_in_breakable_cuda_graph()
    assert seen == [False]


# ---------------------------------------------------------------- capture protocol


@pytest.fixture
def fake(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr(capture_module, "backend", backend)
    return backend


def scale_into(fake, out, x, factor):
    fake.launch(lambda: out.copy_(x * factor))


def test_capture_without_break_is_one_segment(fake):
    x, out = torch.zeros(3), torch.zeros(3)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        scale_into(fake, out, x, 2)
    assert (graph.num_segments, graph.num_breaks) == (1, 0)
    x.copy_(torch.arange(3.0))
    graph.replay()
    assert out.tolist() == [0.0, 2.0, 4.0]


def test_with_output_break_reads_fresh_values_between_segments(fake):
    x, mid, attn, out = (torch.zeros(4) for _ in range(4))
    calls = []

    @eager_on_graph
    def attention(inp, output):
        calls.append(inp.clone())
        output.copy_(inp + 100)

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        scale_into(fake, mid, x, 2)
        assert attention(mid, attn) is None
        scale_into(fake, out, attn, 10)
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    for value in (1.0, 5.0):
        x.fill_(value)
        graph.replay()
        assert out.tolist() == [(2 * value + 100) * 10] * 4
    assert len(calls) == 3  # once at capture, once per replay


def test_returning_break_is_written_back_into_capture_result(fake):
    x, out = torch.zeros(2), torch.zeros(2)

    @eager_on_graph
    def produce(inp):
        return Pair(inp + 1, inp * 3)

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        pair = produce(x)
        fake.launch(lambda: out.copy_(pair.a + pair.b))
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == [9.0, 9.0]


def test_returning_break_with_wrong_shape_names_the_break(fake):
    sizes = iter([2, 3])

    @eager_on_graph
    def shifty():
        return torch.zeros(next(sizes))

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        fake.launch(lambda: None)
        shifty()
    with pytest.raises(GraphReplayError, match=r"break 0 \(.*shifty\).*shape mismatch"):
        graph.replay()


def test_capture_stub_runs_at_capture_real_function_at_replay(fake):
    log = []

    def stub(x):
        log.append("stub")

    @eager_on_graph(capture_stub=stub)
    def real(x):
        log.append("real")

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        real(1)
    graph.replay()
    assert log == ["stub", "real"]


def test_barrier_runs_once_per_break_at_capture_only(fake):
    barriers = []

    @eager_on_graph
    def brk():
        pass

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, barrier_fn=lambda: barriers.append(1)):
        for _ in range(3):
            brk()
    graph.replay()
    graph.replay()
    assert len(barriers) == 3 and graph.num_breaks == 3


def test_nested_break_runs_inline(fake):
    log = []

    @eager_on_graph
    def inner():
        log.append("inner")

    @eager_on_graph
    def outer():
        log.append("outer")
        inner()

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        outer()
    assert graph.num_breaks == 1
    graph.replay()
    assert log == ["outer", "inner", "outer", "inner"]


def test_empty_segments_are_dropped(fake):
    out = torch.zeros(1)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        break_graph()
        break_graph()
        fake.launch(lambda: out.add_(1))
        break_graph()
    assert (graph.num_segments, graph.num_breaks) == (1, 3)
    assert not any(s.was_reset for s in fake.segments)  # they keep holding the pool
    graph.replay()
    assert out.item() == 1.0 and fake.log.count("replay") == 1
    graph.reset()
    assert all(s.was_reset for s in fake.segments)


def test_break_graph_splits_segments(fake):
    out = torch.zeros(1)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        fake.launch(lambda: out.add_(1))
        break_graph()
        fake.launch(lambda: out.mul_(10))
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    graph.replay()
    assert out.item() == 10.0


def test_strong_references_keep_break_arguments_alive(fake):
    @eager_on_graph
    def consume(t):
        pass

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        temp = torch.zeros(8)
        ref = weakref.ref(temp)
        consume(temp)
        del temp
    gc.collect()
    assert ref() is not None
    graph.reset()
    gc.collect()
    assert ref() is None


def test_exception_in_break_during_capture_closes_everything(fake):
    @eager_on_graph
    def boom():
        raise ValueError("bad break")

    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph():
        with pytest.raises(ValueError, match="bad break"), BreakableCUDAGraphCapture(graph):
            fake.launch(lambda: None)
            boom()
        assert is_in_breakable_cuda_graph()
    assert current_capture() is None and _current_stream.get() is None
    assert fake.recording is None and fake.stream.name == "default"
    assert not graph.is_captured and graph.num_segments == 0
    out = torch.zeros(1)
    with BreakableCUDAGraphCapture(graph):
        fake.launch(lambda: out.fill_(3))
    graph.replay()
    assert out.item() == 3.0


def test_exception_inside_segment_during_capture_closes_everything(fake):
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="model bug"), BreakableCUDAGraphCapture(graph):
        fake.launch(lambda: None)
        raise RuntimeError("model bug")
    assert current_capture() is None and fake.recording is None
    assert not graph.is_captured


def test_exception_during_replay_names_the_break(fake):
    fail = [False]

    @eager_on_graph
    def fragile():
        if fail[0]:
            raise KeyError("missing metadata")

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        fake.launch(lambda: None)
        break_graph()
        fake.launch(lambda: None)
        fragile()
    fail[0] = True
    with pytest.raises(GraphReplayError, match=r"break 1 \(tests\.test_graph_cpu\..*fragile\)"):
        graph.replay()
    assert get_current_replay_token() is None


def test_exception_in_a_segment_during_replay_names_the_segment(fake):
    fail = [False]

    def kernel():
        if fail[0]:
            raise RuntimeError("launch failed")

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        fake.launch(lambda: None)
        break_graph()
        fake.launch(kernel)
    fail[0] = True
    with pytest.raises(GraphReplayError, match=r"in segment 1: RuntimeError: launch failed"):
        graph.replay()


def test_misuse_errors(fake):
    with pytest.raises(TypeError, match="BreakableCUDAGraph"):
        BreakableCUDAGraphCapture(object())
    with pytest.raises(RuntimeError, match="not been captured"):
        BreakableCUDAGraph().replay()
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        with pytest.raises(RuntimeError, match="nested"):
            BreakableCUDAGraphCapture(BreakableCUDAGraph()).__enter__()
        fake.launch(lambda: None)
    with pytest.raises(RuntimeError, match="already captured"), BreakableCUDAGraphCapture(graph):
        pass
    graph.reset()
    with BreakableCUDAGraphCapture(graph):
        fake.launch(lambda: None)
    assert graph.is_captured


@pytest.mark.parametrize("make,name", [
    (lambda: eager_on_graph(capture_stub="stub"), "capture_stub"),
    (lambda: eager_on_graph("yes"), "enable"),
    (lambda: eager_on_graph(enable=1), "enable"),
    (lambda: BreakableCUDAGraphCapture(BreakableCUDAGraph(), barrier_fn="barrier"), "barrier_fn"),
])
def test_bad_arguments_are_refused_when_made_naming_them(make, name):
    """Not at the first break, where a non-callable would fail as "'str' object is not
    callable" deep inside a capture."""
    with pytest.raises(TypeError, match=name):
        make()


def test_unknown_capture_error_mode_is_refused():
    with pytest.raises(ValueError, match="capture_error_mode must be one of global"):
        BreakableCUDAGraphCapture(BreakableCUDAGraph(), capture_error_mode="strict")


def test_replay_token_is_new_per_replay_and_visible_in_break(fake):
    tokens = []

    @eager_on_graph
    def record():
        tokens.append(get_current_replay_token())

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        record()
        record()
    graph.replay()
    graph.replay()
    assert tokens[0] is None and tokens[1] is None
    assert tokens[2] == tokens[3] and tokens[4] == tokens[5] and tokens[2] != tokens[4]


def test_pool_is_shared_when_passed(fake):
    first, second = BreakableCUDAGraph(), BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(first, capture_error_mode="thread_local"):
        fake.launch(lambda: None)
    with BreakableCUDAGraphCapture(second, pool=first.pool()):
        fake.launch(lambda: None)
    assert first.pool() == second.pool() == ("pool", 1)
    assert fake.log.count("begin(pool=('pool', 1),mode=thread_local)") == 1


def test_capture_runs_on_its_stream_and_side_streams_are_joined(fake):
    side = FakeStream(fake, "side")

    @eager_on_graph
    def brk():
        assert _current_stream.get().name == "capture"

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        assert fake.stream.name == "capture"
        fork_stream(side)
        fake.launch(lambda: None)
        brk()
        fake.launch(lambda: None)
    log = [entry for entry in fake.log if "<-" in entry or entry in ("end",)]
    assert log == [
        "capture<-default",
        "side<-capture",  # fork
        "capture<-side",  # joined before segment 0 ends
        "end",
        "side<-capture",  # forked again after the break
        "capture<-side",  # joined before segment 1 ends
        "end",
        "default<-capture",
    ]


def test_a_stream_forked_with_plain_wait_stream_is_joined_like_fork_stream(fake):
    """How SGLang's and vLLM's model code forks (e.g. MoE shared experts): no fork_stream."""
    side = FakeStream(fake, "side")
    original = FakeStream.wait_stream
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        side.wait_stream(fake.current_stream())
        fake.launch(lambda: None)
        break_graph()
        fake.launch(lambda: None)
    log = [entry for entry in fake.log if "<-" in entry or entry == "end"]
    assert log == ["capture<-default", "side<-capture", "capture<-side", "end",
                   "side<-capture", "capture<-side", "end", "default<-capture"]
    assert FakeStream.wait_stream is original  # the tracking is gone with the capture
    side.wait_stream(fake.current_stream())  # outside a capture: a plain wait
    assert fake.log[-1] == "side<-default"


def test_a_segment_that_cannot_end_names_the_forked_streams_and_where(fake):
    side = FakeStream(fake, "side")
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match=r"segment 1 .*could not end.*side.* forked in "
                                           r"segment 1 \(after break 0\).*through an event"):
        with BreakableCUDAGraphCapture(graph):
            fake.launch(lambda: None)
            break_graph()
            side.wait_stream(fake.current_stream())
            fake.unjoined_work = True
    assert current_capture() is None and not graph.is_captured
    assert fake.generators_reset == 1  # later random ops in the process still work


def test_leak_check_names_a_break_whose_allocation_outlives_it(fake):
    kept = []

    @eager_on_graph
    def leaky(x):
        kept.append(fake.allocate(16, "leaky_site.py"))  # kept alive, not returned

    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match=r"(?s)break .*leaky leaked 1 CUDA allocation.*64 bytes"
                                           r".*leaky_site.py"):
        with BreakableCUDAGraphCapture(graph, check_leaks=True):
            leaky(torch.zeros(1))
    assert current_capture() is None and fake.recording_allocations


def test_leak_check_accepts_results_marked_outputs_and_temporaries(fake):
    kept = []

    @eager_on_graph
    def returns(x):
        fake.allocate(8, "temporary.py")  # freed at once: not a leak
        return fake.allocate(4, "result.py")

    @eager_on_graph
    def marks(x):
        kept.append(fake.allocate(4, "cache.py"))
        mark_break_output(kept[-1])

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, check_leaks=True):
        returns(torch.zeros(1))
        marks(torch.zeros(1))
    assert graph.num_breaks == 2


def test_leak_check_off_by_default(fake):
    kept = []

    @eager_on_graph
    def leaky():
        kept.append(fake.allocate(16, "leaky_site.py"))

    with BreakableCUDAGraphCapture(BreakableCUDAGraph()):
        leaky()
    assert not fake.recording_allocations


def test_a_segment_that_cannot_end_for_another_reason_does_not_blame_forks(fake):
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match=r"segment 0 of the capture could not end "
                                           r"\(CUDA error: operation failed.*\)$"):
        with BreakableCUDAGraphCapture(graph):
            fake.launch(lambda: None)
            fake.invalidated = True
    assert fake.generators_reset == 1


def test_an_error_inside_a_capture_wins_and_the_generators_are_reset(fake):
    graph = BreakableCUDAGraph()
    with pytest.raises(ValueError, match="model code failed"):
        with BreakableCUDAGraphCapture(graph):
            fake.launch(lambda: None)
            fake.invalidated = True  # the capture cannot end cleanly either
            raise ValueError("model code failed")
    assert fake.generators_reset == 1 and not graph.is_captured


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass(slots=True)
class Slotted:
    kept: torch.Tensor
    color: Color


def test_tensors_in_walks_containers_objects_slots_and_cycles():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    cyclic = types.SimpleNamespace(tensor=c)
    cyclic.me = cyclic
    found = tensors_in(({"a": a}, [Slotted(b, Color.RED)], cyclic, Color.RED, "text", None))
    assert [t.numel() for t in found] == [1, 2, 3]


def test_leak_check_sees_a_leak_beside_a_returned_offset_view(fake):
    kept = []

    @eager_on_graph
    def leaky_view(x):
        kept.append(fake.allocate(16, "leaky_site.py"))
        return fake.allocate(8, "result.py")[4:]  # an offset view of its storage

    with pytest.raises(RuntimeError, match=r"(?s)leaked 1 CUDA allocation.*leaky_site.py"):
        with BreakableCUDAGraphCapture(BreakableCUDAGraph(), check_leaks=True):
            leaky_view(torch.zeros(1))

"""How a breakable replay picks each segment's launch, on the CPU: the driver's stands in
as a logging stub. The first replay launches every segment through torch and learns which
ones draw random numbers (they keep torch's launch); later replays launch the others
through the driver, bound to the current stream and bound again when it changes."""

import pytest
import torch

from bcg.graph import BreakableCUDAGraph, GraphReplayError
from bcg.graph import graph as graph_module


class FakeDevice:
    """The driver-side state the replay reads: the current stream, the generator's offset."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.stream = 7
        self.offset = 0
        self.has_context = True


class FakeSegment:
    def __init__(self, device: FakeDevice, name: str, draws_random: bool = False) -> None:
        self.device, self.name, self.draws_random = device, name, draws_random

    def replay(self) -> None:  # torch's launch: advances the generator if it draws
        self.device.log.append(f"torch {self.name}")
        self.device.offset += 4 if self.draws_random else 0

    def reset(self) -> None:
        pass


@pytest.fixture
def device(monkeypatch) -> FakeDevice:
    fake = FakeDevice()
    monkeypatch.setattr(graph_module, "launches_through_driver", lambda segment: True)
    monkeypatch.setattr(graph_module, "generator_offset", lambda index: fake.offset)
    monkeypatch.setattr(graph_module, "current_raw_stream", lambda index: fake.stream)
    monkeypatch.setattr(graph_module, "thread_has_context", lambda: fake.has_context)
    monkeypatch.setattr(graph_module, "driver_launcher", lambda segment, stream: (
        lambda: fake.log.append(f"driver {segment.name} on {stream}")))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def make_graph(device: FakeDevice, failing_break: list[bool] | None = None) -> BreakableCUDAGraph:
    """segment 0 (draws random numbers), break 0, segment 1, break 1, segment 2."""

    def brk(name: str) -> None:
        if failing_break and failing_break[0]:
            raise RuntimeError("break failed")
        device.log.append(name)

    graph = BreakableCUDAGraph()
    graph._add_segment(FakeSegment(device, "s0", draws_random=True), empty=False)
    graph._add_break(brk, ("b0",), {}, capture_result=None)
    graph._add_segment(FakeSegment(device, "s1"), empty=False)
    graph._add_break(brk, ("b1",), {}, capture_result=None)
    graph._add_segment(FakeSegment(device, "s2"), empty=False)
    graph._finish_capture()
    return graph


def replay_log(graph: BreakableCUDAGraph, device: FakeDevice) -> list[str]:
    device.log.clear()
    graph.replay()
    return list(device.log)


def test_the_first_replay_launches_through_torch_and_finds_the_random_segment(device):
    graph = make_graph(device)
    assert replay_log(graph, device) == ["torch s0", "b0", "torch s1", "b1", "torch s2"]
    assert graph._random_segments == {0}
    assert replay_log(graph, device) == ["torch s0", "b0", "driver s1 on 7", "b1",
                                         "driver s2 on 7"]


def test_a_new_stream_binds_the_driver_launches_again(device):
    graph = make_graph(device)
    graph.replay()
    graph.replay()
    device.stream = 9
    assert replay_log(graph, device)[2] == "driver s1 on 9"
    device.stream = 7
    assert replay_log(graph, device)[4] == "driver s2 on 7"


def test_a_first_replay_that_fails_is_learned_again_and_reset_forgets(device):
    failing = [True]
    graph = make_graph(device, failing)
    with pytest.raises(GraphReplayError, match="break 0"):
        graph.replay()
    assert graph._random_segments is None
    failing[0] = False
    assert replay_log(graph, device)[0] == "torch s0"
    assert graph._random_segments == {0}
    graph.reset()
    assert (graph._random_segments, graph._driver_segments, graph._steps_by_stream) == (
        None, {}, {})


def test_a_thread_with_no_cuda_context_yet_replays_through_torch(device):
    graph = make_graph(device)
    graph.replay()
    device.has_context = False
    assert replay_log(graph, device) == ["torch s0", "b0", "torch s1", "b1", "torch s2"]
    device.has_context = True
    assert replay_log(graph, device)[2] == "driver s1 on 7"

"""bench_graph's CPU-side logic: a breakable graph's replay taken apart into its segment
launches and its break calls, in replay order."""

import importlib

import torch

from bcg.graph import BreakableCUDAGraph

bench_graph = importlib.import_module("bench.bench_graph")


class FakeSegment:
    """Stands in for a captured CUDA graph segment (only `replay` is used)."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def replay(self) -> None:
        self.log.append(self.name)


def test_replay_parts_split_segments_from_breaks_in_replay_order():
    log: list[str] = []
    graph = BreakableCUDAGraph()
    graph._add_segment(FakeSegment(log, "segment 0"), empty=False)
    graph._add_break(log.append, ("break 0",), {}, capture_result=None)
    graph._add_segment(FakeSegment(log, "segment 1"), empty=False)
    result = torch.zeros(2)
    graph._add_break(lambda: log.append("break 1") or torch.ones(2), (), {},
                     capture_result=result)
    graph._finish_capture()
    segments, breaks = bench_graph.replay_parts(graph.replay)
    assert log == ["segment 0", "break 0", "segment 1", "break 1"]  # its first replay
    log.clear()
    bench_graph.calls(segments)()
    bench_graph.calls(breaks)()
    assert log == ["segment 0", "segment 1", "break 0", "break 1"]
    assert result.tolist() == [1.0, 1.0]  # a break with a result copies it back as in replay

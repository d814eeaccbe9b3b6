"""Breakable CUDA graphs: capture a region as CUDA graph segments with eager breaks.

This layer depends on torch only and knows nothing about language models.
"""

from bcg.graph.breaks import break_graph, eager_on_graph, fork_stream, mark_break_output
from bcg.graph.bridge import BridgeBuffers, bridge_buffer, use_bridge_buffers
from bcg.graph.buffer_pool import clear_shared_buffers, share_buffer
from bcg.graph.capture import (
    BreakableCUDAGraphCapture,
    CaptureNeedsWarmUp,
    abandon_capture,
    current_capture,
)
from bcg.graph.context import (
    enable_breakable_cuda_graph,
    get_current_replay_token,
    get_current_stream,
    is_in_breakable_cuda_graph,
)
from bcg.graph.copy_output import copy_output
from bcg.graph.graph import BreakableCUDAGraph, GraphReplayError
from bcg.graph.registry import GraphBufferRegistry
from bcg.graph.slots import FillContext, GraphSlot, PaddingPolicy

__all__ = [
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "CaptureNeedsWarmUp",
    "abandon_capture",
    "BridgeBuffers",
    "FillContext",
    "GraphBufferRegistry",
    "GraphReplayError",
    "GraphSlot",
    "PaddingPolicy",
    "break_graph",
    "bridge_buffer",
    "clear_shared_buffers",
    "copy_output",
    "current_capture",
    "eager_on_graph",
    "enable_breakable_cuda_graph",
    "fork_stream",
    "get_current_replay_token",
    "get_current_stream",
    "is_in_breakable_cuda_graph",
    "mark_break_output",
    "share_buffer",
    "use_bridge_buffers",
]

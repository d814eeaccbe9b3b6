"""The step channels between tensor-parallel ranks: the group's (gloo, 2 processes) with a
plan that fits the first broadcast, one that needs the second, and shutdown; the pipes' (a
thread for rank 0) with plans larger than a pipe's buffer, shutdown, and rank 0 gone;
StepPlan's bytes round trip."""

import threading
from array import array
from multiprocessing import Pipe

import pytest
import torch
import torch.multiprocessing as mp

from bcg.distributed import step_channel
from bcg.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    spawned_group_store,
    tensor_parallel,
)
from bcg.distributed.step_channel import (
    INLINE_BYTES,
    GroupStepChannel,
    PipeStepChannel,
    open_step_channel,
)
from bcg.runner.batch import HostBatch
from bcg.runner.step_plan import StepPlan
from tests.server_process import free_port

MESSAGES = [b"small", bytes(range(256)) * (3 * INLINE_BYTES // 256 + 1), b""]


def a_plan() -> StepPlan:
    longs, ints = array("q", range(-3, 40)), array("i", range(7, 30))
    # a hybrid's mixed batch (one decode first): its 2 sequences' state slots ride along
    return StepPlan(HostBatch(longs, ints, 9, 2, 2, 4, 6, 11, 1, True), array("q", [0, 5, 8]))


def test_step_plan_round_trip():
    plan = a_plan()
    assert StepPlan.from_bytes(plan.to_bytes()) == plan


def rank_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(2, "gloo", spawned_group_store(2, rank, port), rank)
    try:
        channel = GroupStepChannel(tensor_parallel())
        if rank == 0:
            for message in MESSAGES:
                channel.send(message)
            channel.send_shutdown()
            return
        received = []
        while (message := channel.receive()) is not None:
            received.append(message)
        assert received == MESSAGES, [len(m) for m in received]
    finally:
        destroy_tensor_parallel()


def test_messages_larger_than_the_first_broadcast_arrive_whole():
    assert len(MESSAGES[1]) > INLINE_BYTES
    mp.spawn(rank_main, args=(free_port(),), nprocs=2, join=True)


def send_then_shut_down(channel: PipeStepChannel, messages: list[bytes]) -> None:
    """Rank 0's side, closing its end after (or on an error: the reader then fails at the
    end of file instead of waiting for good)."""
    try:
        for message in messages:
            channel.send(message)
        channel.send_shutdown()
    finally:
        channel.pipes[0].close()


def test_the_pipes_carry_plans_larger_than_their_buffer_then_the_shutdown():
    receiver, sender = Pipe(duplex=False)
    large = bytes(range(256)) * (1 << 12)  # 1 MiB: the writer waits for the reader
    messages = [*MESSAGES, large]
    rank_0 = threading.Thread(target=send_then_shut_down, daemon=True,  # never holds pytest
                              args=(PipeStepChannel((sender,)), messages))
    rank_0.start()
    channel, received = PipeStepChannel((receiver,)), []
    while (message := channel.receive()) is not None:
        received.append(message)
    rank_0.join()
    assert received == messages


def test_a_worker_whose_rank_0_ended_without_shutdown_stops_with_an_error():
    receiver, sender = Pipe(duplex=False)
    PipeStepChannel((sender,)).send(b"plan")
    sender.close()
    channel = PipeStepChannel((receiver,))
    assert channel.receive() == b"plan"
    with pytest.raises(RuntimeError, match="closed its step channel without shutting down"):
        channel.receive()


def test_rank_0s_send_to_a_worker_that_ended_names_its_rank():
    receivers, senders = zip(*(Pipe(duplex=False) for _ in range(2)), strict=True)
    receivers[1].close()
    channel = PipeStepChannel(senders)
    with pytest.raises(RuntimeError, match="rank 2's step pipe broke"):
        channel.send(b"plan")
    with pytest.raises(RuntimeError, match="rank 2's step pipe broke"):
        channel.send_shutdown()


def test_rank_0_waiting_on_a_full_pipe_gives_up_once_a_worker_failed(monkeypatch):
    """A worker that does not read (stuck) while another failed: rank 0's write of a plan
    larger than the pipe's buffer ends with an error instead of waiting for good."""
    receiver, sender = Pipe(duplex=False)
    monkeypatch.setattr(step_channel, "WRITE_WAIT_SECONDS", 0.01)
    waits = []
    monkeypatch.setattr(step_channel, "peer_failed", lambda: len(waits) > 2 or waits.append(1))
    with pytest.raises(RuntimeError, match="failed while rank 0 waited"):
        PipeStepChannel((sender,)).send(bytes(1 << 22))  # 4 MiB: no pipe holds it
    receiver.close()


def test_without_pipes_the_steps_go_through_the_group():
    assert isinstance(open_step_channel(TensorParallel(0, 2, cpu_group="cpu")), GroupStepChannel)
    receiver, _ = Pipe(duplex=False)
    tp = TensorParallel(1, 2, step_pipes=(receiver,))
    assert isinstance(open_step_channel(tp), PipeStepChannel)

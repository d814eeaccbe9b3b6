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

from bcg.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    spawned_group_store,
    tensor_parallel,
)
from bcg.distributed.step_channel import INLINE_BYTES, GroupStepChannel, PipeStepChannel
from bcg.runner.batch import HostBatch
from bcg.runner.step_plan import StepPlan
from tests.server_process import free_port

MESSAGES = [b"small", bytes(range(256)) * (3 * INLINE_BYTES // 256 + 1), b"\x00"]


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
    for message in messages:
        channel.send(message)
    channel.send_shutdown()


def test_the_pipes_carry_plans_larger_than_their_buffer_then_the_shutdown():
    receiver, sender = Pipe(duplex=False)
    large = bytes(range(256)) * (1 << 12)  # 1 MiB: the writer waits for the reader
    messages = [*MESSAGES, large]
    rank_0 = threading.Thread(target=send_then_shut_down,
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


def test_rank_0s_send_to_a_worker_that_ended_raises():
    receiver, sender = Pipe(duplex=False)
    receiver.close()
    with pytest.raises(OSError):
        PipeStepChannel((sender,)).send(b"plan")

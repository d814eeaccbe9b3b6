"""The step channel between tensor-parallel ranks (gloo, 2 processes): a plan that fits the
first broadcast, one that needs the second, and shutdown; StepPlan's bytes round trip."""

from array import array

import torch
import torch.multiprocessing as mp

from bcg.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    spawned_group_store,
    tensor_parallel,
)
from bcg.distributed.step_channel import INLINE_BYTES, StepChannel
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
        channel = StepChannel(tensor_parallel())
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

"""The loop of a tensor-parallel worker (ranks 1..N-1): build the same runner as rank 0 on
this rank's device, then run every step rank 0 sends (`StepPlan`) until it shuts down.

Rank 0 launches the workers itself (`launcher`; here `run_started_worker` and
`spawned_worker_main`: one host, devices 0..N-1, readiness to join and failure reported
through a pipe, the steps read from another), or torchrun starts every rank
(`launched_worker_main`, env-style initialisation, on cuda:LOCAL_RANK; the steps come by
the CPU group's broadcast).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import BinaryIO, NoReturn

import torch
import torch.distributed as dist

from bcg.config import EngineConfig
from bcg.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    local_rank,
    spawned_group_store,
    wait_for_spawned_group,
)
from bcg.runner.step_plan import StepPlan

logger = logging.getLogger(__name__)

PARENT_CHECK_SECONDS = 1.0


def rank_config(config: EngineConfig, device_index: int) -> EngineConfig:
    """`config` for this rank: its own GPU (cuda:`device_index`, made the process's current
    device, so that a GPU that cannot be used fails here); on the CPU, its share of the cores
    (ranks that each run all of them fight over them and every step slows down; this sets
    the calling process's torch threads)."""
    if config.torch_device.type == "cuda":
        config = copy.copy(config)  # not `replace`: the checks refuse cuda:N at size > 1
        config.device = f"cuda:{device_index}"
        torch.cuda.set_device(config.torch_device)
        return config
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // config.tensor_parallel_size))
    return config


def join_group(config: EngineConfig, store: dist.Store | None = None,
               rank: int | None = None,
               step_pipes: tuple[Connection, ...] = ()) -> TensorParallel:
    """Join the tensor-parallel group on this rank's device (`config` from `rank_config`):
    NCCL on GPUs, gloo on the CPU; env-style, or through `store` as `rank` with the
    `step_pipes` between rank 0 and the workers it spawned."""
    device = config.torch_device
    backend = "nccl" if device.type == "cuda" else "gloo"
    return init_tensor_parallel(config.tensor_parallel_size, backend, store, rank, device,
                                step_pipes)


def serve_steps(config: EngineConfig, store_port: int | None = None,
                rank: int | None = None,
                before_joining: Callable[[], None] | None = None,
                step_pipe: Connection | None = None) -> None:
    """Join the group (calling `before_joining` first), build this rank's runner as rank 0
    builds its own, and run rank 0's steps (from `step_pipe`, if rank 0 spawned this
    worker) until it shuts down."""
    from bcg.runner.startup import start_runner  # before "joining": the runner's imports

    # Spawned by rank 0 on its host: the device index is the rank. Under torchrun: LOCAL_RANK.
    config = rank_config(config, local_rank() if rank is None else rank)
    if before_joining is not None:
        before_joining()
    store = None
    if store_port is not None:
        store = spawned_group_store(config.tensor_parallel_size, rank, store_port)
        wait_for_spawned_group(store)
    join_group(config, store, rank, (step_pipe,) if step_pipe is not None else ())
    runner = start_runner(config)
    try:
        while (message := runner.step_channel.receive()) is not None:
            plan = StepPlan.from_bytes(message)
            runner.run_plan(plan)
            runner.keep_samples(plan.batch.num_samples)
    finally:
        runner.close()  # its graphs go before the group (or the process)
    destroy_tensor_parallel()


def launched_worker_main(config: EngineConfig) -> NoReturn:
    """A rank that a launcher (torchrun) started: serve rank 0's steps, then end the process
    (the script that built the engine must not go on as if it had one): with 0 once rank 0
    shuts down, or with 1 and the error logged naming this rank (torchrun then ends the
    others)."""
    try:
        serve_steps(config)
    except BaseException:  # noqa: BLE001 - logged, then the process ends
        logger.exception("tensor-parallel rank %s failed", os.environ.get("RANK", "?"))
        logging.shutdown()
        os._exit(1)  # not SystemExit: nothing of the caller's may run on a broken rank
    raise SystemExit(0)


def run_started_worker(stream: BinaryIO) -> None:
    """The program of a worker rank 0 started (`launcher.WORKER_PROGRAM`): read its entry
    point (`spawned_worker_main`, unless a test swapped it) and arguments, and run it with
    its reports' pipe and its steps' pipe."""
    entry, config, rank, store_port, reports_fd, steps_fd = pickle.load(stream)
    for fd in (reports_fd, steps_fd):
        os.set_inheritable(fd, False)  # processes this one starts must not hold them open
    entry(config, rank, store_port, Connection(reports_fd, readable=False),
          Connection(steps_fd, writable=False))


def spawned_worker_main(config: EngineConfig, rank: int, store_port: int,
                        reports: Connection, steps: Connection) -> None:
    """A worker that rank 0 spawned: serve the steps it reads from `steps`, reporting
    "joining" just before it joins the group (rank 0 waits for that, not for the group's
    rendezvous, which it cannot cut short), and on any error report it (rank 0 raises it,
    naming this rank) and exit at once: a collective left waiting on this rank then fails
    on rank 0 instead of hanging."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank; rank 0 decides
    _exit_with_parent()
    try:
        serve_steps(config, store_port, rank, lambda: reports.send(("joining", "")), steps)
    except BaseException as error:  # noqa: BLE001 - reported, then the process ends
        _report(reports, error)
        os._exit(1)


def _report(reports: Connection, error: BaseException) -> None:
    last = traceback.extract_tb(error.__traceback__)[-1:]
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    try:
        reports.send(("failed", f"{type(error).__name__}: {error}{where}"))
    except OSError:  # rank 0 is gone: nobody to tell
        pass


def _exit_with_parent() -> None:
    """End this worker when rank 0's process dies (a collective waiting on it could wait
    forever: NCCL does not notice a peer's death)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="bcg-parent-watch", daemon=True).start()

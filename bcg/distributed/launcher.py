"""Rank 0's side of tensor parallelism: size checks, launching the worker processes (their
own loop is `rank_loop`), naming a failed worker, and ending every rank.

Unless torchrun started every rank, rank 0 starts ranks 1..N-1 on this host as fresh Python
processes that import bcg's runner and nothing of the caller's: not its script, as
multiprocessing's spawn would (the benches' scripts took seconds to import, and a script
without an `if __name__ == "__main__":` guard built a second engine in every worker). Rank
0 waits for each to report that it has imported the runner and taken its GPU (a death
before is an error at once, not a hang), then lets them into the group's rendezvous
together. Each worker reads its steps from a pipe of its own (`step_channel`). A thread
then watches the workers: one that raises reports its exception and exits, so rank 0's
collective with it, or its next write of a step to it, fails within moments (gloo sees the
closed connection, the pipe is broken; on GPUs the NCCL group is aborted), and rank 0
raises an error naming that rank and its exception.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed.distributed_c10d as c10d

from bcg.config import EngineConfig, require
from bcg.distributed import rank_loop
from bcg.distributed.parallel_state import (
    SPAWNED_START_TIMEOUT,
    TensorParallel,
    abandon_tensor_parallel,
    destroy_tensor_parallel,
    launched_rank,
    local_rank,
    refuse_if_abandoned,
    release_custom_all_reduce_waits,
    release_spawned_group,
    spawned_group_store,
)
from bcg.models.config import ModelConfig
from bcg.timing import startup_step

if TYPE_CHECKING:
    from bcg.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

T = TypeVar("T")

FAILURE_REPORT_SECONDS = 3.0  # how long a failed collective waits for a worker's report
ABORT_AFTER_SECONDS = 2.0  # a failed worker's NCCL peers are aborted after this
# NCCL's abort returns only once every CUDA graph that captured a collective of the group is
# gone; close() destroys rank 0's, then waits this long for it.
ABORT_WAIT_SECONDS = 30.0
JOIN_SECONDS = 30.0  # a worker's clean exit at shutdown (it frees its GPU)
# A worker's program: the caller's import path, then its entry point and arguments on stdin.
WORKER_PROGRAM = ("import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
                  "from bcg.distributed.rank_loop import run_started_worker; "
                  "run_started_worker(sys.stdin.buffer)")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot step any more."""


def check_tensor_parallel_size(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse a size the model or the machine cannot take, before any weight loads (and say
    when expert parallelism is asked of a model without experts)."""
    if config.enable_expert_parallel and not model.num_experts:
        logger.warning("enable_expert_parallel has no effect: this model has no experts, so "
                       "its layers are split by tensor parallelism alone")
    size = config.tensor_parallel_size
    if size == 1:
        return
    tp = TensorParallel(0, size)
    tp.shard(model.num_attention_heads, "num_attention_heads")
    tp.kv_heads(model.num_key_value_heads)
    tp.shard(model.intermediate_size, "intermediate_size")
    if model.num_experts and config.enable_expert_parallel:
        tp.shard(model.num_experts, "num_experts")
    elif model.num_experts:
        tp.shard(model.moe_intermediate_size, "moe_intermediate_size")
    if config.torch_device.type == "cuda":
        per_host = size if launched_rank() is None else int(
            os.environ.get("LOCAL_WORLD_SIZE", size))
        visible = torch.cuda.device_count()
        require(per_host <= visible,
                f"tensor_parallel_size={size} needs {per_host} GPUs on this host but "
                f"{visible} are visible: lower it, or check CUDA_VISIBLE_DEVICES")


class Workers:
    """The other ranks as rank 0 sees them (none at tensor-parallel size 1)."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        if self.size > 1:
            refuse_if_abandoned()  # before any worker starts
        self.spawned = self.size > 1 and launched_rank() is None
        self.processes: list[subprocess.Popen] = []
        self.runner: ModelRunner | None = None  # rank 0's, once built: closed before the group
        self.failure: tuple[int, str] | None = None  # the first worker that failed
        self.broken: str | None = None  # why the ranks can no longer step together
        self._failed = threading.Event()
        self._closing = False
        self._group_lock = threading.Lock()  # the failure timer's abort vs close()
        self._abort: threading.Thread | None = None  # NCCL's abort of the group, once begun
        self._abort_failure: str | None = None  # what that abort raised, if it did
        self._reports: list[Connection] = []  # each worker's reports, by rank - 1
        self._step_pipes: list[Connection] = []  # rank 0's end of each worker's steps' pipe
        self._watcher: threading.Thread | None = None
        self.nccl = config.torch_device.type == "cuda"
        self.config = config  # rank 0's: its own device
        if self.size == 1:
            return
        # Rank 0 that spawns its workers takes cuda:0 whatever LOCAL_RANK a parent process
        # left in the environment; under torchrun its own LOCAL_RANK.
        device_index = 0 if self.spawned else local_rank()
        self._num_threads = torch.get_num_threads()  # rank_config sets this process's share
        self.config = config = rank_loop.rank_config(config, device_index)
        if not self.spawned:
            rank_loop.join_group(config)
            return
        store = spawned_group_store(self.size, rank=0)
        try:
            with startup_step("tensor-parallel workers spawned"):
                self._spawn(config, store.port)
                self._wait_until_joining()
            release_spawned_group(store)
            self._watcher = threading.Thread(target=self._watch, name="bcg-tp-watch",
                                             daemon=True)
            self._watcher.start()
            with startup_step("tensor-parallel group formed"), self.failures_named():
                rank_loop.join_group(config, store, 0, tuple(self._step_pipes))
        except BaseException:
            self.broken = "it failed to start"  # close() then waits for no worker
            self.close()
            raise

    def _spawn(self, config: EngineConfig, store_port: int) -> None:
        # rank 0's interpreter flags (-X, -W, -O...), as multiprocessing's spawn passes them
        command = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c",
                   WORKER_PROGRAM]
        for rank in range(1, self.size):
            receiver, sender = Pipe(duplex=False)  # its reports
            try:
                steps_receiver, steps_sender = Pipe(duplex=False)  # its steps
            except BaseException:
                receiver.close()
                sender.close()
                raise
            # The worker's ends keep their numbers in the worker.
            reports_fd, steps_fd = sender.fileno(), steps_receiver.fileno()
            try:
                process = subprocess.Popen(command, stdin=subprocess.PIPE,
                                           pass_fds=(reports_fd, steps_fd))
            except BaseException:
                receiver.close()
                steps_sender.close()
                raise
            finally:
                sender.close()  # end of file here once the worker exits
                steps_receiver.close()  # a broken pipe for rank 0's writes once it exits
            self.processes.append(process)
            self._reports.append(receiver)
            self._step_pipes.append(steps_sender)
            try:
                with process.stdin:  # far less than a pipe's buffer: written at once
                    pickle.dump(sys.path, process.stdin)
                    pickle.dump((rank_loop.spawned_worker_main, config, rank, store_port,
                                 reports_fd, steps_fd), process.stdin)
            except OSError:  # it ended before reading them
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} failed to start: {_gone(process, 5)} "
                    "before it read its arguments; its output above says why") from None

    def _each_worker(self) -> Iterator[tuple[int, subprocess.Popen, Connection]]:
        for index, process in enumerate(self.processes):
            yield index + 1, process, self._reports[index]

    def _wait_until_joining(self) -> None:
        """Each worker's word that it has imported the runner and is joining the group. One
        that fails or exits before is named at once (the group's rendezvous would only time
        out), and so is one silent for `SPAWNED_START_TIMEOUT`."""
        seconds = SPAWNED_START_TIMEOUT.total_seconds()
        deadline = time.monotonic() + seconds
        for rank, process, reports in self._each_worker():
            if not reports.poll(max(0.0, deadline - time.monotonic())):
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} failed to start: it did not join the group "
                    f"within {seconds:.0f} s; its output above may say why")
            message = _receive(reports)
            if message is None or message[0] != "joining":
                detail = message[1] if message else (
                    f"{_gone(process, 5)} before it joined the group; its output above says "
                    "why")
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def _watch(self) -> None:
        """Wait for the first worker to report an error or exit (its reports' end of file);
        record it (and on GPUs abort the group, so that rank 0 does not wait in a
        collective forever)."""
        ranks = {reports: rank for rank, _, reports in self._each_worker()}
        while ranks and not self._closing:
            for ready in wait(list(ranks)):
                rank = ranks.pop(ready)
                message = _receive(ready)
                if message is not None and message[0] == "failed":
                    self._record(rank, message[1])
                elif not self._closing:
                    self._record(rank, _gone(self.processes[rank - 1], 1))

    def _record(self, rank: int, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = (rank, message)
        logger.error("tensor-parallel rank %d failed: %s", rank, message)
        self._failed.set()
        if self.nccl:  # NCCL waits for a dead peer forever: abort the group
            timer = threading.Timer(ABORT_AFTER_SECONDS, self._abort_after_failure)
            timer.daemon = True
            timer.start()
        release_custom_all_reduce_waits()  # rank 0 may wait in its kernel for the rank

    def _abort_after_failure(self) -> None:
        """The timer's abort: not once close() has begun (it aborts the group itself if a
        worker failed, and destroys it otherwise)."""
        with self._group_lock:
            if not self._closing:
                self._start_abort()

    def _start_abort(self) -> threading.Thread:
        """Abort the group on a thread of its own, once (under `_group_lock`). NCCL's abort
        ends the collectives that wait for the dead peer at once, so the step comes back, but
        returns only when every CUDA graph that captured a collective of the group is
        destroyed: close() destroys rank 0's after starting it, then waits for it."""
        if self._abort is None:
            self._abort = threading.Thread(target=self._run_abort, name="bcg-tp-abort",
                                           daemon=True)
            self._abort.start()
        return self._abort

    def _run_abort(self) -> None:
        """The abort thread's work. What the abort raises is kept for close(): destroying a
        group that was not aborted would wait for the dead peer."""
        try:
            self._abort_group()
        except Exception as error:  # noqa: BLE001 (close() reports it)
            self._abort_failure = f"torch's abort of the NCCL group raised {error!r}"

    def _abort_if_out_of_step(self, in_step: bool) -> threading.Thread | None:
        """An NCCL group out of step (a peer failed, or rank 0 broke in a step): its abort,
        begun now if the timer has not begun it (destroying the group would wait for a peer
        that may never come, and so would destroying rank 0's graphs while a collective of
        theirs waits). None: the group is to be destroyed."""
        if self.size == 1 or not self.nccl or (in_step and self.failure is None):
            return None
        with self._group_lock:
            return self._start_abort()

    def _leave_group(self, abort: threading.Thread | None) -> None:
        """Destroy the group, or once its `abort` returns let it go; if the abort does not
        return in time or raises, leave the group as it is."""
        if abort is not None:
            abort.join(ABORT_WAIT_SECONDS)
        if abort is None or not (abort.is_alive() or self._abort_failure):
            destroy_tensor_parallel()
            return
        reason = self._abort_failure or (f"torch's abort of the NCCL group did not return "
                                         f"within {ABORT_WAIT_SECONDS:g} s after a rank failed")
        logger.error("%s: the group is left as it is, and this process cannot start another "
                     "tensor-parallel engine (start a new process)", reason)
        abandon_tensor_parallel(reason)

    def _abort_group(self) -> None:
        abort = getattr(c10d, "_abort_process_group", None)
        if abort is None:
            logger.warning("this torch has no torch.distributed _abort_process_group: rank 0 "
                           "may wait in a collective with the failed rank until NCCL's timeout")
        elif c10d.is_initialized():
            abort()

    def error(self) -> TensorParallelError:
        if self.failure is not None:
            rank, message = self.failure
            return TensorParallelError(f"tensor-parallel rank {rank} failed: {message}")
        return TensorParallelError(f"the engine cannot step any more ({self.broken}): "
                                   "start a new one")

    @contextmanager
    def failures_named(self) -> Iterator[None]:
        """Run work in which every rank takes part. If it raises because a worker failed,
        raise that worker's error; after any failure the ranks are out of step for good."""
        if self.failure is not None or self.broken is not None:
            raise self.error()
        try:
            yield
        except BaseException as error:
            if self.size == 1:
                raise
            self.broken = f"rank 0 stopped in a step: {type(error).__name__}"
            # A collective fails the moment a peer exits; its report may be on its way.
            # Rank 0's own clear errors (bad input) and Ctrl-C stand as they are.
            if (isinstance(error, Exception) and not isinstance(error, ValueError)
                    and self._failed.wait(FAILURE_REPORT_SECONDS if self.spawned else 0)):
                raise self.error() from error
            raise
        if self.failure is not None:
            # The step "finished", but a worker failed in it: on GPUs the aborted NCCL
            # collectives return whatever their buffers held, so its results are garbage.
            self.broken = "a worker failed in a step"
            raise self.error()

    def run_step(self, step: Callable[..., T], *args: Any) -> T:
        """`step(*args)` under `failures_named`, or as it is with no other rank to fail."""
        if self.size == 1:
            return step(*args)
        with self.failures_named():
            return step(*args)

    def close(self) -> None:
        """End every rank: tell the workers to stop (unless they are out of step), release
        rank 0's graphs, leave the group, then wait for the workers (terminating any that do
        not end)."""
        with self._group_lock:
            if self._closing:
                return
            self._closing = True
        in_step = self.failure is None and self.broken is None
        self.broken = self.broken or "it was closed"
        channel = getattr(self.runner, "step_channel", None)
        if channel is not None and in_step:
            try:
                channel.send_shutdown()
            except (RuntimeError, OSError):  # a worker is gone (the group's error, or a pipe's)
                in_step = False
        abort = self._abort_if_out_of_step(in_step)
        if self.runner is not None:
            self.runner.close()  # its graphs captured collectives of the group
        if self.size > 1:
            self._leave_group(abort)
        for process in self.processes:
            _end(process, JOIN_SECONDS if in_step else 0)
        if self._watcher is not None:
            self._watcher.join(JOIN_SECONDS)
        for pipe in self._reports + self._step_pipes:
            pipe.close()
        if self.size > 1:
            torch.set_num_threads(self._num_threads)  # the caller's own again


def _receive(reports: Connection) -> tuple[str, str] | None:
    try:
        return reports.recv()
    except (EOFError, OSError):
        return None


def _exit_code(process: subprocess.Popen, seconds: float) -> int | None:
    """The exit code of a worker whose reports ended: it exits within moments."""
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def _gone(process: subprocess.Popen, seconds: float) -> str:
    """How a worker whose reports ended is gone: its exit code, once it has exited."""
    code = _exit_code(process, seconds)
    if code is None:
        return "its reports ended while its process still runs"
    return f"its process exited with code {code}"


def _end(process: subprocess.Popen, seconds: float) -> None:
    """Wait `seconds` for a worker to exit, then terminate it, then kill it."""
    if _exit_code(process, seconds) is None:
        process.terminate()
        if _exit_code(process, 5) is None:
            process.kill()
            process.wait()

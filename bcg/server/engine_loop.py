"""One background thread owns the `LLMEngine` and steps it for every HTTP request at once.

The engine is not thread-safe, so everything that touches it (tokenizing, adding, aborting,
stepping) runs on this thread. Coroutines hand it work through a command queue and get
their outputs back on an asyncio queue per HTTP request, filled with
`loop.call_soon_threadsafe`. Requests from different HTTP calls share every step:
continuous batching across clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bcg.distributed.launcher import TensorParallelError
from bcg.engine.chat import ChatOptions
from bcg.engine.llm_engine import BadPromptError, LLMEngine
from bcg.engine.outputs import CompletionOutput, RequestOutput
from bcg.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation and how to render it."""

    messages: list[dict[str, Any]]
    options: ChatOptions


Prompt = str | list[int] | ChatPrompt  # text, token ids, or a conversation


@dataclass
class EngineSnapshot:
    """What /metrics reports; refreshed by the engine thread after every step."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0  # prefilled (prompt tokens the prefix cache lacked)
    num_generation_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    forwards: dict[str, int] = field(default_factory=dict)  # "eager", "<kind> graph" -> count


@dataclass
class _Route:
    outputs: asyncio.Queue
    index: int  # which choice of its HTTP request
    last: RequestOutput  # the latest output, to end it with on shutdown


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="bcg-engine", daemon=True)
        self.fatal: TensorParallelError | None = None  # the engine cannot step any more
        self.on_fatal: Callable[[], None] = lambda: None  # told once `fatal` is set

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def end_all(self) -> None:
        """Abort every request in flight, each ending with finish_reason 'abort' so its
        client gets a complete response (used on shutdown); returns at once."""
        self._commands.put(self._end_all)

    def stop(self) -> None:
        """Abort whatever is still running and join the engine thread: wholly, so that no
        step runs when the engine closes (closing tensor-parallel workers talks to them)."""
        self._commands.put(None)
        self._thread.join()

    async def add(
        self,
        prompts: list[Prompt],
        make_params: Callable[[int, list[int]], SamplingParams],
        outputs: asyncio.Queue,
    ) -> list[str]:
        """Queue one engine request per prompt, its params `make_params(i, prompt i's token
        ids)` (called on the engine thread, which tokenized the prompt: the caller may keep
        what it needs of the tokens); prompt i's outputs arrive on `outputs` as
        (i, RequestOutput). All or none are added: ValueError on bad input."""
        return await self.call(lambda: self._add_all(prompts, make_params, outputs))

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (finished ones are skipped) and free their KV blocks; returns
        at once, so it is safe where awaiting is not (a closing generator)."""
        self._commands.put(lambda: self._abort(request_ids))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps (what touches the engine or its
        tokenizer) and return its result; its exceptions are raised here."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except Exception as error:  # handed to the caller, which decides
                future.set_exception(error)

        self._commands.put(command)
        return await asyncio.wrap_future(future)

    def _add_all(self, prompts: list[Prompt],
                 make_params: Callable[[int, list[int]], SamplingParams],
                 outputs: asyncio.Queue) -> list[str]:
        token_ids = self._token_ids(prompts)
        params = [make_params(i, tokens) for i, tokens in enumerate(token_ids)]
        ids = self.engine.add_requests(token_ids, params)
        for index, (request_id, tokens) in enumerate(zip(ids, token_ids, strict=True)):
            self._routes[request_id] = _Route(outputs, index, _no_output_yet(request_id, tokens))
        self.snapshot.num_requests += len(ids)
        self.snapshot.num_prompt_tokens += sum(len(t) for t in token_ids)
        return ids

    def _token_ids(self, prompts: list[Prompt]) -> list[list[int]]:
        """Each prompt's token ids; a prompt repeated for n > 1 choices is the same object,
        tokenized once."""
        done: dict[int, list[int]] = {}
        for index, prompt in enumerate(prompts):
            if id(prompt) not in done:
                try:
                    done[id(prompt)] = self._tokenize(prompt)
                except ValueError as error:  # named as add_requests names a bad prompt
                    raise BadPromptError(index, str(error)) from error
        return [done[id(prompt)] for prompt in prompts]

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):
            return self.engine.chat_prompt(prompt.messages, prompt.options)[1]
        return self.engine.tokenize(prompt)

    def _abort(
        self,
        request_ids: list[str],
        reply: Callable[[_Route], RequestOutput | Exception] | None = None,
        count: bool = True,
    ) -> None:
        """Abort these requests and free their blocks; `reply` gives what each client gets
        (nothing if None); `count` them as finished by abort."""
        deliveries = []
        for request_id in request_ids:
            route = self._routes.pop(request_id, None)
            if route is None:
                continue
            self.engine.abort_request(request_id)
            if count:
                self._count_finished("abort")
            if reply is not None:
                deliveries.append((route.outputs, (route.index, reply(route))))
        self._deliver(deliveries)
        self._refresh_snapshot()

    def _run(self) -> None:
        while True:
            block = not self.engine.has_unfinished_requests()
            if not self._run_commands(block):
                break
            if self.engine.has_unfinished_requests():
                self._step()
        self._abort(list(self._routes))
        logger.info("engine loop stopped")

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting for one if `block`); False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(error)
            if isinstance(error, TensorParallelError) and self.fatal is None:
                self.fatal = error  # every later step would fail too: the server stops
                self.on_fatal()
            return
        deliveries = []
        for output in outputs:
            route = self._routes[output.request_id]  # every request is added with its route
            # A step adds a token at most; a scored prompt (max_tokens=0) generates none.
            grew = len(output.outputs[0].token_ids) > len(route.last.outputs[0].token_ids)
            self.snapshot.num_generation_tokens += grew
            route.last = output
            if output.finished:
                del self._routes[output.request_id]
                self._count_finished(output.outputs[0].finish_reason)
            deliveries.append((route.outputs, (route.index, output)))
        self._deliver(deliveries)
        self._refresh_snapshot()

    def _count_finished(self, reason: str) -> None:
        # A new dict, not an update: /metrics iterates it from the event loop's thread.
        finished = self.snapshot.finished
        self.snapshot.finished = {**finished, reason: finished.get(reason, 0) + 1}

    def _end_all(self) -> None:
        self._abort(list(self._routes),
                    lambda route: replace(route.last, finished=True, outputs=[
                        replace(route.last.outputs[0], finish_reason="abort")]))

    def _fail_all(self, error: Exception) -> None:
        self._abort(list(self._routes), lambda route: error, count=False)

    def _deliver(self, deliveries: list[tuple[asyncio.Queue, tuple]]) -> None:
        """Put each item on its client's queue, waking the event loop once for all of them
        (a wake-up per item costs a syscall and a GIL hand-off: ~0.5 ms a step at 256)."""
        if not deliveries:
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(_put_all, deliveries)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _refresh_snapshot(self) -> None:
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        snap = self.snapshot
        snap.num_running = len(scheduler.running)
        snap.num_waiting = len(scheduler.waiting)
        snap.kv_cache_usage = 1 - blocks.num_free_blocks / blocks.num_blocks
        snap.num_computed_prompt_tokens = self.engine.stats.prefill_tokens
        snap.forwards = dict(self.engine.runner.forward_counts)


def _put_all(deliveries: list[tuple[asyncio.Queue, tuple]]) -> None:
    for outputs, item in deliveries:
        outputs.put_nowait(item)


def _no_output_yet(request_id: str, prompt_token_ids: list[int]) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_token_ids,
                         outputs=[CompletionOutput(0, "", [], None)], finished=False)

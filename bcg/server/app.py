"""The FastAPI application: OpenAI routes over one `EngineLoop`.

Every generation route turns its body into engine requests (one per prompt and choice),
then either collects the outputs into one JSON response or streams them as server-sent
events. A client that goes away aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from bcg.engine.llm_engine import LLMEngine
from bcg.engine.outputs import RequestOutput
from bcg.server.engine_loop import EngineLoop, Prompt
from bcg.server.metrics import render_metrics
from bcg.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    make_usage,
    new_id,
    now,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_SECONDS = 0.5


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def create_app(engine: LLMEngine, model_name: str) -> FastAPI:
    engine_loop = EngineLoop(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.stop()

    app = FastAPI(title="bcg", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    _add_error_handlers(app)
    server = _Server(engine_loop, model_name, engine.max_model_len)

    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)
    app.get("/metrics")(server.metrics)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    return app


class _Server:
    def __init__(self, engine_loop: EngineLoop, model_name: str, max_model_len: int) -> None:
        self.engine_loop = engine_loop
        self.model_name = model_name
        self.max_model_len = max_model_len

    async def health(self) -> dict:
        return {"status": "ok"}

    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": now(), "owned_by": "bcg",
                "max_model_len": self.max_model_len}
        return {"object": "list", "data": [card]}

    async def metrics(self) -> PlainTextResponse:
        text = render_metrics(self.engine_loop.snapshot, self.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def completions(self, body: CompletionRequest, request: Request):
        prompts = body.prompts()
        if not prompts:
            raise ApiError("the prompt is empty", param="prompt")
        run = await self._start(body, prompts, COMPLETION_DEFAULT_MAX_TOKENS)
        formatter = _CompletionFormat(run)
        if body.stream:
            return _sse(run.stream(formatter.chunks()))
        return formatter.response(await run.collect(request))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        messages = [m.as_template_input() for m in body.messages]
        run = await self._start(body, [messages], self.max_model_len)
        formatter = _ChatFormat(run)
        if body.stream:
            return _sse(run.stream(formatter.chunks()))
        return formatter.response(await run.collect(request))

    async def _start(self, body: SamplingFields, prompts: list[Prompt],
                     default_max_tokens: int) -> _Run:
        if body.model != self.model_name:
            raise ApiError(f"model {body.model!r} is not served here; this server serves "
                           f"{self.model_name!r} (see GET /v1/models)", param="model")
        engine_prompts = [p for p in prompts for _ in range(body.n)]
        try:
            params = [body.sampling_params(j, default_max_tokens)
                      for _ in prompts for j in range(body.n)]
            outputs: asyncio.Queue = asyncio.Queue()
            ids = await self.engine_loop.add(engine_prompts, params, outputs)
        except ValueError as error:
            raise ApiError(str(error)) from error
        return _Run(self.engine_loop, body, self.model_name, ids, outputs)


class _Run:
    """The engine requests of one HTTP request, and their outputs as they come."""

    def __init__(self, engine_loop: EngineLoop, body: SamplingFields, model_name: str,
                 request_ids: list[str], outputs: asyncio.Queue) -> None:
        self.engine_loop = engine_loop
        self.body = body
        self.model_name = model_name
        self.request_ids = request_ids
        self.outputs = outputs
        self.id = new_id("cmpl" if isinstance(body, CompletionRequest) else "chatcmpl")
        self.created = now()
        self.final: dict[int, RequestOutput] = {}

    async def results(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every choice finished."""
        while len(self.final) < len(self.request_ids):
            index, output = await self.outputs.get()
            if isinstance(output, ConnectionError):
                raise output
            if isinstance(output, Exception):
                raise ApiError(f"the engine failed: {output}", status=500)
            if output.finished:
                self.final[index] = output
            yield index, output

    async def collect(self, request: Request) -> dict[int, RequestOutput]:
        """Every choice's final output; a client that disconnects first aborts them."""
        watcher = asyncio.create_task(self._abort_on_disconnect(request))
        try:
            async for _ in self.results():
                pass
        finally:
            watcher.cancel()
            self.engine_loop.abort(self.request_ids)
        return self.final

    async def _abort_on_disconnect(self, request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        self.outputs.put_nowait((-1, ConnectionError("the client disconnected")))

    async def stream(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except ApiError as error:
            yield f"data: {json.dumps(error_body(str(error), error.status))}\n\n"
        finally:
            self.engine_loop.abort(self.request_ids)

    def usage(self) -> dict:
        n = self.body.n
        prompt_tokens = sum(len(self.final[i].prompt_token_ids)
                            for i in range(0, len(self.request_ids), n))
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in self.final.values())
        return make_usage(prompt_tokens, completion_tokens).model_dump()

    def header(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}


class _CompletionFormat:
    def __init__(self, run: _Run) -> None:
        self.run = run

    def response(self, final: dict[int, RequestOutput]) -> dict:
        choices = [_completion_choice(i, final[i].outputs[0].text,
                                      final[i].outputs[0].finish_reason) for i in sorted(final)]
        return {**self.run.header("text_completion"), "choices": choices,
                "usage": self.run.usage()}

    async def chunks(self) -> AsyncIterator[dict]:
        sent = _DeltaTracker()
        async for index, output in self.run.results():
            completion = output.outputs[0]
            choice = _completion_choice(index, sent.delta(index, completion.text),
                                        completion.finish_reason)
            yield {**self.run.header("text_completion"), "choices": [choice]}
        if self.run.body.include_usage:
            yield {**self.run.header("text_completion"), "choices": [],
                   "usage": self.run.usage()}


class _ChatFormat:
    def __init__(self, run: _Run) -> None:
        self.run = run

    def response(self, final: dict[int, RequestOutput]) -> dict:
        choices = [{"index": i,
                    "message": {"role": "assistant", "content": final[i].outputs[0].text},
                    "logprobs": None,
                    "finish_reason": _finish_reason(final[i].outputs[0].finish_reason)}
                   for i in sorted(final)]
        return {**self.run.header("chat.completion"), "choices": choices,
                "usage": self.run.usage()}

    async def chunks(self) -> AsyncIterator[dict]:
        header = self.run.header("chat.completion.chunk")
        for index in range(len(self.run.request_ids)):
            yield {**header, "choices": [_chat_delta(index, {"role": "assistant", "content": ""})]}
        sent = _DeltaTracker()
        async for index, output in self.run.results():
            completion = output.outputs[0]
            delta = {"content": sent.delta(index, completion.text)}
            yield {**header, "choices": [_chat_delta(index, delta, completion.finish_reason)]}
        if self.run.body.include_usage:
            yield {**header, "choices": [], "usage": self.run.usage()}


class _DeltaTracker:
    """The new text of each choice since the last chunk (outputs carry all text so far)."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def delta(self, index: int, text: str) -> str:
        start = self.sent.get(index, 0)
        self.sent[index] = len(text)
        return text[start:]


def _completion_choice(index: int, text: str, reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None,
            "finish_reason": _finish_reason(reason)}


def _chat_delta(index: int, delta: dict, reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None,
            "finish_reason": _finish_reason(reason)}


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error_body(str(error), error.status, error.param), error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = [_describe(problem) for problem in error.errors()]
        first_param = _field_path(error.errors()[0]) if error.errors() else None
        return JSONResponse(error_body("; ".join(problems), 400, first_param or None), 400)

    @app.exception_handler(ConnectionError)
    async def client_gone(_: Request, error: ConnectionError) -> JSONResponse:
        return JSONResponse(error_body(str(error), 400), 400)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {error!r}", 500), 500)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), error.status_code), error.status_code)


def _describe(problem: dict) -> str:
    if problem.get("type") == "json_invalid":
        return f"the body is not valid JSON ({problem.get('ctx', {}).get('error', 'parse error')})"
    path = _field_path(problem)
    return f"{path}: {problem['msg']}" if path else problem["msg"]


def _field_path(problem: dict) -> str:
    return ".".join(str(part) for part in problem.get("loc", ()) if part != "body")

"""The FastAPI application: OpenAI routes (and vLLM's extra ones) over one `EngineLoop`.

Every generation route turns its body into engine requests (one per prompt and choice),
then either collects the outputs into one JSON response or streams them as server-sent
events. A client that goes away aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from bcg import __version__
from bcg.config import FieldError
from bcg.engine.llm_engine import BadPromptError, LLMEngine
from bcg.engine.outputs import RequestOutput
from bcg.loader.builtin import BUILTIN_NAME
from bcg.server.engine_loop import ChatPrompt, EngineLoop, EngineSnapshot, Prompt
from bcg.server.logprobs import (
    EchoText,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_text,
    prompt_logprobs_json,
)
from bcg.server.metrics import render_metrics
from bcg.server.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_body,
    make_usage,
    new_id,
    now,
)
from bcg.server.serve import ServerSettings

DISCONNECT_POLL_SECONDS = 0.5

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("bcg.server.access")


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def create_app(engine: LLMEngine, model_name: str,
               settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    engine_loop = EngineLoop(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        stats = None
        if not settings.disable_log_stats:
            stats = asyncio.create_task(_log_stats(engine_loop.snapshot,
                                                   settings.log_stats_interval))
        yield
        if stats is not None:
            stats.cancel()
        engine_loop.stop()
        snap = engine_loop.snapshot
        logger.info("server stopped after %d engine requests (%d prompt tokens, %d generated "
                    "tokens; finished: %s)", snap.num_requests, snap.num_prompt_tokens,
                    snap.num_generation_tokens, snap.finished or "none")

    app = FastAPI(title="bcg", version=__version__, lifespan=lifespan)
    app.state.engine_loop = engine_loop
    app.state.settings = settings
    _add_error_handlers(app)
    app.add_middleware(_BodySizeLimit, limit=settings.max_request_body_bytes)
    if not settings.disable_access_log:
        app.add_middleware(_AccessLog)  # added last: outermost, so it logs 413s too
    server = _Server(engine, engine_loop, model_name, settings)

    app.add_api_route("/health", server.health, methods=["GET", "HEAD"])
    app.get("/version")(server.version)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model:path}")(server.model)  # a served name may hold slashes
    app.get("/metrics")(server.metrics)
    app.get("/tokenizer_info")(server.tokenizer_info)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    return app


class _Server:
    def __init__(self, engine: LLMEngine, engine_loop: EngineLoop, model_name: str,
                 settings: ServerSettings) -> None:
        self.engine = engine  # only on the engine thread (`EngineLoop.call`)
        self.engine_loop = engine_loop
        self.model_name = model_name
        self.settings = settings
        self.max_model_len = engine.max_model_len
        self.model_root = engine.config.model or BUILTIN_NAME  # what was loaded (vLLM's root)
        self.vocab_size = engine.model_config.vocab_size
        self.tokenizer = engine.tokenizer
        self.eos_token_ids = sorted(engine.eos_token_ids)

    async def health(self) -> dict:
        return {"status": "ok"}

    async def version(self) -> dict:
        return {"version": __version__}

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str) -> dict:
        """OpenAI's retrieve: the served model's card, 404 for another name."""
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "bcg",
                "root": self.model_root, "parent": None, "permission": [],
                "max_model_len": self.max_model_len}

    async def metrics(self) -> PlainTextResponse:
        text = render_metrics(self.engine_loop.snapshot, self.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def tokenizer_info(self) -> JSONResponse:
        return JSONResponse(await self.engine_loop.call(self._tokenizer_info))

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError("send either `prompt` (text) or `messages` (a conversation)",
                           param="prompt")
        self._require_tokenizer("tokenizing")
        tokenizer = self.tokenizer
        if body.prompt is not None:
            chat_fields = sorted(body.model_fields_set & set(ChatTemplateFields.model_fields))
            if chat_fields:
                raise ApiError(f"{', '.join(chat_fields)} apply to `messages` only, not to a "
                               "`prompt`", param=chat_fields[0])
            special = body.add_special_tokens is not False
            encode = lambda: tokenizer.encode(body.prompt, add_special_tokens=special)
        else:
            chat = self._chat_prompt(body)
            encode = lambda: self.engine.chat_token_ids(chat.messages, chat.options)

        def run() -> dict:
            tokens = encode()
            strings = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
            return {"count": len(tokens), "max_model_len": self.max_model_len,
                    "tokens": tokens, "token_strs": strings}

        return JSONResponse(await self._on_engine_thread(run))

    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        self._check_model(body.model)
        self._require_tokenizer("detokenizing")
        bad = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(f"token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {self.vocab_size})", param="tokens")
        text = await self._on_engine_thread(lambda: self.tokenizer.decode(body.tokens))
        return JSONResponse({"prompt": text})

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)  # a 404 before any complaint about the body
        prompts = body.prompts()
        if not prompts:
            raise ApiError("the prompt is empty", param="prompt")
        run = await self._start(body, prompts)
        formatter = _CompletionFormat(run)
        if body.stream:
            return run.stream(formatter.chunks())
        return JSONResponse(formatter.response(await run.collect(request)))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)  # a 404 before any complaint about the body
        run = await self._start(body, [self._chat_prompt(body)])
        formatter = _ChatFormat(run)
        if body.stream:
            return run.stream(formatter.chunks())
        return JSONResponse(formatter.response(await run.collect(request)))

    async def _start(self, body: SamplingFields, prompts: list[Prompt]) -> _Run:
        """Check the request, then add its engine requests: choice i of prompt p is engine
        request p * n + i."""
        unsupported = body.unsupported()
        if unsupported is not None:
            field, why = unsupported
            raise ApiError(f"{field}: {why}", param=field)
        n = body.num_choices
        limit = self.settings.max_sequences_per_request
        if len(prompts) * n > limit:
            raise ApiError(
                f"this request asks for {len(prompts) * n} sequences ({len(prompts)} prompts x "
                f"n={n}) but the server allows {limit} per request "
                "(--max-sequences-per-request): split it", param="n" if n > 1 else "prompt")
        try:
            params = body.sampling_params()
        except FieldError as error:
            param = body.param_of(error.field)
            raise ApiError(_named_as(str(error), error.field, param), param=param) from error
        echo = isinstance(body, CompletionRequest) and body.echo
        echoes: dict[int, EchoText] = {}  # prompt index -> its echo strings

        def make_params(index: int, token_ids: list[int]):
            """On the engine thread: the params, and the echo strings (the tokenizer's)."""
            if echo and index % n == 0:
                echoes[index // n] = echo_text(self.tokenizer, token_ids,
                                               not isinstance(prompts[index // n], str))
            return params.for_choice(index % n)

        engine_prompts = [p for p in prompts for _ in range(n)]
        outputs: asyncio.Queue = asyncio.Queue()
        try:
            ids = await self.engine_loop.add(engine_prompts, make_params, outputs)
        except BadPromptError as error:  # named by the body's prompt, not the engine's request
            where = f"prompt {error.index // n}: " if len(prompts) > 1 else ""
            if error.field is None:
                reason, param = error.reason, body.prompt_field
            else:
                param = body.param_of(error.field)
                reason = _named_as(error.reason, error.field, param)
            raise ApiError(where + reason, param=param) from error
        except ValueError as error:
            raise ApiError(str(error)) from error
        return _Run(self.engine_loop, body, self.model_name, engine_prompts, ids, outputs,
                    echoes)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(f"the model {model!r} does not exist here; this server serves "
                           f"{self.model_name!r} (see GET /v1/models)", status=404,
                           param="model")

    def _require_tokenizer(self, what: str) -> None:
        """Refuse a request that needs the tokenizer (`what` it does) when there is none."""
        if self.tokenizer is None:
            raise ApiError(f"this model has no tokenizer, which {what} needs: start the server "
                           "with --tokenizer")

    async def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        try:
            return await self.engine_loop.call(fn)
        except ValueError as error:
            raise ApiError(str(error)) from error

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> ChatPrompt:
        """The body's conversation; for messages, add_special_tokens is false unless set."""
        try:
            return body.chat_prompt(bool(body.add_special_tokens),
                                    self.settings.chat_template_text)
        except FieldError as error:  # contradicting options, or reserved template variables
            raise ApiError(str(error), param=error.field) from error

    def _tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's init arguments (special tokens as
        strings, no file paths), its class and chat template, and the special token ids."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return {"tokenizer_class": None, "chat_template": None, "bos_token_id": None,
                    "eos_token_id": self.eos_token_ids[0] if self.eos_token_ids else None,
                    "eos_token_ids": self.eos_token_ids}
        info = {key: _jsonable(value) for key, value in
                (getattr(tokenizer, "init_kwargs", None) or {}).items()
                if key not in ("vocab_file", "merges_file", "tokenizer_file")}
        info.update(tokenizer_class=type(tokenizer).__name__,
                    chat_template=self.settings.chat_template_text or tokenizer.chat_template,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, eos_token_ids=self.eos_token_ids)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[name] = getattr(tokenizer, name, None)
        return info


class _Run:
    """The engine requests of one HTTP request, and their outputs as they come."""

    def __init__(self, engine_loop: EngineLoop, body: SamplingFields, model_name: str,
                 prompts: list[Prompt], request_ids: list[str],
                 outputs: asyncio.Queue, echoes: dict[int, EchoText] | None = None) -> None:
        self.engine_loop = engine_loop
        self.body = body
        self.model_name = model_name
        self.prompts = prompts  # per engine request (choice index)
        self.request_ids = request_ids
        self.outputs = outputs
        self.echoes = echoes or {}  # prompt index -> its echo strings (echo only)
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

    def stream(self, chunks: AsyncIterator[dict]) -> StreamingResponse:
        """The chunks as server-sent events; however the response ends (done, the client
        gone, even before the first event), the requests are aborted."""
        return _EventStream(_events(chunks), lambda: self.engine_loop.abort(self.request_ids))

    def usage(self) -> dict:
        n = self.body.num_choices
        prompt_tokens = sum(len(self.final[i].prompt_token_ids)
                            for i in range(0, len(self.request_ids), n))
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in self.final.values())
        return make_usage(prompt_tokens, completion_tokens).model_dump()

    def header(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}


@dataclass
class _Sent:
    """What a choice's chunks have carried so far (outputs carry everything so far)."""

    chars: int = 0
    tokens: int = 0
    echoed: bool = False
    offset: int = 0  # text offset of the next token string (completion logprobs)

    def new_text(self, text: str) -> str:
        start, self.chars = self.chars, len(text)
        return text[start:]

    def new_tokens(self, output: RequestOutput) -> tuple[list[int], list]:
        completion = output.outputs[0]
        start, self.tokens = self.tokens, len(completion.token_ids)
        token_ids = completion.token_ids[start:]
        if completion.logprobs is None:
            return token_ids, [None] * len(token_ids)
        return token_ids, completion.logprobs[start:]


class _CompletionFormat:
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.body: CompletionRequest = run.body

    def response(self, final: dict[int, RequestOutput]) -> dict:
        choices = [self._choice(i, final[i], _Sent()) for i in sorted(final)]
        return {**self.run.header("text_completion"), "choices": choices,
                "usage": self.run.usage()}

    async def chunks(self) -> AsyncIterator[dict]:
        sent: dict[int, _Sent] = {}
        async for index, output in self.run.results():
            choice = self._choice(index, output, sent.setdefault(index, _Sent()))
            yield {**self.run.header("text_completion"), "choices": [choice]}
        if self.body.include_usage:
            yield {**self.run.header("text_completion"), "choices": [],
                   "usage": self.run.usage()}

    def _choice(self, index: int, output: RequestOutput, sent: _Sent) -> dict:
        """The text (and logprobs) of `output` that `sent` has not carried yet; echo puts
        the prompt's in front of the first."""
        completion = output.outputs[0]
        text = sent.new_text(completion.text)
        token_ids, positions = sent.new_tokens(output)
        strings = TokenText()
        if self.body.echo:
            echo = self.run.echoes[index // self.body.num_choices]
            strings = echo.tokens
        if self.body.echo and not sent.echoed:
            sent.echoed = True
            prompt = self.run.prompts[index]
            prompt_ids = output.prompt_token_ids
            text = (prompt if isinstance(prompt, str) else echo.text) + text
            prompt_positions = output.prompt_logprobs or [None] * len(prompt_ids)
            token_ids, positions = [*prompt_ids, *token_ids], [*prompt_positions, *positions]
        choice = {"index": index, "text": text, "logprobs": None,
                  "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(token_ids, positions, self.body.logprobs, strings,
                                           sent.offset)
            sent.offset += sum(len(token) for token in logprobs["tokens"])
            choice["logprobs"] = logprobs
        if self.body.prompt_logprobs is not None and output.finished:
            choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return choice


class _ChatFormat:
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.body: ChatCompletionRequest = run.body

    def response(self, final: dict[int, RequestOutput]) -> dict:
        choices = []
        for index in sorted(final):
            completion = final[index].outputs[0]
            choices.append({"index": index,
                            "message": {"role": "assistant", "content": completion.text},
                            "logprobs": self._logprobs(final[index], _Sent()),
                            "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason})
        response = {**self.run.header("chat.completion"), "choices": choices,
                    "usage": self.run.usage()}
        if self.body.prompt_logprobs is not None and final:
            response["prompt_logprobs"] = prompt_logprobs_json(final[0].prompt_logprobs)
        return response

    async def chunks(self) -> AsyncIterator[dict]:
        header = self.run.header("chat.completion.chunk")
        for index in range(len(self.run.request_ids)):
            yield {**header, "choices": [_chat_delta(index, {"role": "assistant", "content": ""},
                                                     None, None, None)]}
        sent: dict[int, _Sent] = {}
        async for index, output in self.run.results():
            state = sent.setdefault(index, _Sent())
            completion = output.outputs[0]
            delta = {"content": state.new_text(completion.text)}
            yield {**header, "choices": [_chat_delta(index, delta, self._logprobs(output, state),
                                                     completion.finish_reason,
                                                     completion.stop_reason)]}
        if self.body.include_usage:
            yield {**header, "choices": [], "usage": self.run.usage()}

    def _logprobs(self, output: RequestOutput, sent: _Sent) -> dict | None:
        token_ids, positions = sent.new_tokens(output)
        if not self.body.logprobs:
            return None
        return {"content": chat_logprobs(token_ids, positions, self.body.top_logprobs or 0,
                                         TokenText())}  # generated tokens: all decoded


def _chat_delta(index: int, delta: dict, logprobs: dict | None, reason: str | None,
                stop_reason: int | str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
            "stop_reason": stop_reason}


async def _events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    except ApiError as error:
        yield f"data: {json.dumps(error_body(str(error), error.status))}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events, then `on_close()` however the response ends: a generator's
    `finally` would not run if the client left before the first event was asked for."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _jsonable(value: Any) -> Any:
    """Tokenizer arguments as JSON: special tokens (AddedToken) as their text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)


async def _log_stats(snap: EngineSnapshot, interval: float) -> None:
    """vLLM's periodic line: throughput over the last interval, while there is work."""
    last = (snap.num_computed_prompt_tokens, snap.num_generation_tokens, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        current = (snap.num_computed_prompt_tokens, snap.num_generation_tokens, time.monotonic())
        busy = snap.num_running or snap.num_waiting
        if busy or current[:2] != last[:2]:
            seconds = current[2] - last[2]
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                        "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                        (current[0] - last[0]) / seconds, (current[1] - last[1]) / seconds,
                        snap.num_running, snap.num_waiting, 100 * snap.kv_cache_usage)
        last = current


class _AccessLog:
    """One line per request once its response is complete: client, request line, status,
    duration (streams: until the last event)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, logged = 500, False

        async def send_and_log(message) -> None:
            nonlocal status, logged
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                logged = True
                _log_access(scope, status, start)

        try:
            await self.app(scope, receive, send_and_log)
        finally:
            if not logged:
                _log_access(scope, status, start)


def _log_access(scope, status: int, start: float) -> None:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    query = scope.get("query_string", b"").decode("latin-1")
    target = scope.get("path", "") + (f"?{query}" if query else "")
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    access_logger.info('%s - "%s %s HTTP/%s" %d %s %.1f ms', where, scope.get("method"), target,
                       scope.get("http_version", "1.1"), status, phrase,
                       1000 * (time.perf_counter() - start))


class _BodySizeLimit:
    """413 for a body over `limit` bytes: at once when Content-Length says so (nothing of
    the body is read), else (chunked) as soon as the bytes read pass it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                response = _error_response(self._message(int(length)), 413)
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
            return await self.app(scope, receive, send)  # the server holds it to its length
        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, self._message(None), {"connection": "close"})
            return message

        await self.app(scope, receive_limited, send)

    def _message(self, length: int | None) -> str:
        size = "the request body" if length is None else f"the request body ({length} bytes)"
        return (f"{size} is larger than this server's limit of {self.limit} bytes "
                "(--max-request-body-bytes)")


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote what the client sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(message: str, status: int, param: str | None = None,
                    headers: dict | None = None) -> JSONResponse:
    return _AsciiJSONResponse(error_body(message, status, param), status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return _error_response(str(error), error.status, error.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = [_describe(problem) for problem in error.errors()]
        first = error.errors()[0] if error.errors() else {}
        return _error_response("; ".join(problems), 400, _param(first) or None)

    @app.exception_handler(ConnectionError)
    async def client_gone(_: Request, error: ConnectionError) -> JSONResponse:
        return _error_response(str(error), 400)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return _error_response(f"internal error: {error!r}", 500)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        cause = error.__cause__
        if isinstance(cause, UnicodeDecodeError):  # FastAPI's message would say only "error"
            return _error_response(f"the body is not valid UTF-8 (byte {cause.start}): send "
                                   "JSON encoded as UTF-8", 400)
        if isinstance(cause, RecursionError):  # the JSON parser's own limit
            return _error_response("the body's JSON is nested too deeply to parse: send "
                                   "fewer levels of lists and objects", 400)
        return _error_response(str(error.detail), error.status_code, headers=error.headers)


def _named_as(message: str, field: str, param: str) -> str:
    """A sampling param's message opens with its name: the body's name for it instead
    (max_completion_tokens is max_tokens to the engine)."""
    if param != field and message.startswith(field):
        return param + message[len(field):]
    return message


def _describe(problem: dict) -> str:
    kind = problem.get("type")
    if kind == "json_invalid":
        where = (problem.get("loc") or ("body",))[-1]  # ("body", the character offset)
        return (f"the body is not valid JSON ({problem.get('ctx', {}).get('error', 'parse error')}"
                + (f" at character {where})" if isinstance(where, int) else ")"))
    if kind == "lone_surrogate":
        return problem["msg"]
    path = _field_path(problem)
    if not path:  # the body as a whole
        if kind == "missing":
            return "the body is empty: send the request's fields as a JSON object"
        return ("the body must be a JSON object of the request's fields, sent with "
                "content-type: application/json")
    if kind == "extra_forbidden":
        return (f"{path}: unknown field: this server does not implement it (see the README's "
                "Serving section for the fields it takes)")
    message = problem["msg"].removeprefix("Value error, ")
    return f"{path}: {message}" if path else message


def _param(problem: dict) -> str:
    if problem.get("type") == "lone_surrogate":
        return problem.get("ctx", {}).get("path", "")
    if problem.get("type") == "json_invalid":  # its place is a character offset, not a field
        return ""
    return _field_path(problem)


def _field_path(problem: dict) -> str:
    return ".".join(str(part) for part in problem.get("loc", ()) if part != "body")

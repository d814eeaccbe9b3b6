"""`bcg serve` on 127.0.0.1 with the built-in SmolLM2, driven by the official openai client."""

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bcg.engine.sampling_params import SamplingParams
from tests.builtin_model import require_builtin_model
from tests.server_process import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    QUESTION,
    running_server,
    send_headers_only,
)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

@pytest.fixture(scope="module")
def server():
    require_builtin_model()
    # Overlapped steps, as on CUDA by default: streams, stop strings, disconnects and
    # concurrent requests (checked against offline generate's plain steps) all go through them.
    with running_server(["--max-model-len", str(MAX_MODEL_LEN), "--overlap"]) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(base: str) -> dict[str, float]:
    """'bcg_name' -> value, for the metrics without extra labels."""
    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("bcg_") and "," not in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            values[name] = float(value)
    return values


def test_serve_has_every_engine_flag(capsys):
    from bcg.cli import build_parser
    from bcg.config import EngineConfig

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ["--host", "--port"] + ["--" + f.name.replace("_", "-")
                                        for f in dataclasses.fields(EngineConfig)]:
        assert flag in help_text


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    response = httpx.get(f"{server}/v1/models/other/model", timeout=10)
    assert response.status_code == 404 and "'other/model' does not exist" in response.text
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_completion_and_chat(client):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                           temperature=0)
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                          temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"


def test_streamed_text_equals_the_full_response(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices

    full_chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                               temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == full_chat.choices[0].message.content


def test_n_choices_and_seeds(client):
    def sample(seed):
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3,
                                             temperature=1.0, top_p=0.95, seed=seed,
                                             extra_body={"top_k": 50})
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = sample(7)
    assert len(first) == 3
    assert sample(7) == first
    assert sample(8) != first


def test_a_batch_of_prompts_gets_n_choices_each(client):
    prompts = [PROMPT, "The capital of France is"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2,
                                      temperature=0)
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
               .choices[0].text for p in prompts]
    assert texts == [singles[0], singles[0], singles[1], singles[1]]
    assert batch.usage.completion_tokens == 24


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[10:14]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=[stop, "never-appears"])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_concurrent_requests_equal_offline_generate(client):
    from bcg.engine.llm import LLM

    prompts = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(32)]

    def complete(prompt):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                             temperature=0)
        return response.choices[0].text

    with ThreadPoolExecutor(max_workers=32) as pool:
        texts = list(pool.map(complete, prompts, timeout=120))
    llm = LLM(device="cpu", max_model_len=MAX_MODEL_LEN)
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)
    assert texts == [o.outputs[0].text for o in expected]


BAD_REQUESTS = [
    ("malformed json", "/v1/completions", '{"model": "x", "prompt": ', 400,
     "not valid JSON (Expecting value at character 25)"),
    ("an array body", "/v1/completions", '[1, 2]', 400, "must be a JSON object"),
    ("an empty body", "/v1/completions", '', 400, "the body is empty"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("mistyped max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                "max_tokens": "ten"}, 400, "max_tokens"),
    ("mistyped messages", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400,
     "messages"),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                 "temperature": -1}, 400, "temperature"),
    ("top_p out of range", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 2.0},
     400, "top_p"),
    ("zero max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0},
     400, "max_tokens"),
    ("n of zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "hello " * 600}, 400,
     "max_model_len"),
    ("token id out of vocabulary", "/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400,
     "vocabulary"),
    ("unknown role", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "gpt-9"),
    ("unknown route", "/v1/nothing-here", {"model": MODEL}, 404, "Not Found"),
]


@pytest.mark.parametrize("name,path,body,status,message", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_an_error_and_the_server_keeps_serving(server, client, name, path, body,
                                                              status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server}{path}", content=content, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"]
    assert error["param"] is None or not error["param"].isdigit()  # a field, not an offset
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.choices[0].text


def _wait_until_idle(server: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = _metrics(server)
        if metrics["bcg_kv_cache_usage"] == 0 and metrics["bcg_num_requests_running"] == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"the KV cache was not freed after the client left: {metrics}")


def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert _metrics(server)["bcg_kv_cache_usage"] > 0
    _wait_until_idle(server)


def test_a_client_that_gives_up_waiting_frees_its_kv_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5)
    _wait_until_idle(server)
    finished = httpx.get(f"{server}/metrics", timeout=10).text
    assert 'reason="abort"' in finished


def test_a_rejected_batch_counts_no_request_and_no_abort(server):
    """Its first prompt was added before the second was refused: that one is rolled back,
    so /metrics shows neither a request nor an abort for the batch."""
    def counts():
        text = httpx.get(f"{server}/metrics", timeout=10).text
        aborts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("bcg_requests_finished_total") and 'reason="abort"' in line]
        return _metrics(server)["bcg_requests_total"], sum(aborts)

    before = counts()
    body = {"model": MODEL, "prompt": ["Hi", "hello " * 600], "max_tokens": 2}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]
    assert counts() == before


def test_a_prompt_repeated_for_n_choices_is_tokenized_once():
    from bcg.server.engine_loop import EngineLoop

    class CountingEngine:
        calls = 0

        def tokenize(self, text):
            CountingEngine.calls += 1
            return [ord(c) for c in text]

    loop = EngineLoop(CountingEngine())
    text, other = "hello", "hi"
    assert loop._token_ids([text, text, text, other]) == [[104, 101, 108, 108, 111]] * 3 + [
        [104, 105]]
    assert CountingEngine.calls == 2


def test_default_limits(server):
    status, headers, body = send_headers_only(server, "/v1/completions", 9 * 2**20)
    assert status == 413 and headers["connection"] == "close"
    assert "8388608" in body["error"]["message"]
    assert "--max-request-body-bytes" in body["error"]["message"]
    prompts = [[1, 2, 3]] * 129
    response = httpx.post(f"{server}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 1})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "258" in message and "256" in message and "--max-sequences-per-request" in message
    assert httpx.head(f"{server}/health", timeout=10).status_code == 200


# --- in process: the engine thread, stream aborts, counters ----------------------------------


class _ThreadRecordingTokenizer:
    """The engine's tokenizer, noting which threads call it."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.threads: set[str] = set()

    def __getattr__(self, name):
        value = getattr(self._tokenizer, name)
        if callable(value):
            def recorded(*args, **kwargs):
                import threading

                self.threads.add(threading.current_thread().name)
                return value(*args, **kwargs)
            return recorded
        return value


def test_only_the_engine_thread_uses_the_tokenizer():
    """Echo of a token-id prompt (its text, its first token's string) and /tokenize's chat
    variants are made on the engine thread, not on the event loop's."""
    require_builtin_model()
    from starlette.testclient import TestClient

    from bcg.config import EngineConfig
    from bcg.engine.llm_engine import LLMEngine
    from bcg.server.app import create_app
    from bcg.server.serve import ServerSettings

    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN))
    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    expected_text = tokenizer.decode(prompt_ids)
    expected_first = tokenizer.decode(prompt_ids[:1])
    default_chat = engine.chat_token_ids(QUESTION)
    recording = engine.tokenizer = _ThreadRecordingTokenizer(tokenizer)
    app = create_app(engine, MODEL, ServerSettings(disable_log_stats=True,
                                                   disable_access_log=True))
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 2, "temperature": 0,
            "echo": True, "logprobs": 1}
    with TestClient(app) as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["text"].startswith(expected_text)
        assert choice["logprobs"]["tokens"][0] == expected_first
        events = http.post("/v1/completions", json={**body, "stream": True}).text
        first = json.loads(events.split("\n\n")[0].removeprefix("data: "))["choices"][0]
        assert first["text"].startswith(expected_text)
        assert first["logprobs"]["tokens"][0] == expected_first
        assert http.post("/tokenize", json={"messages": QUESTION}).json()[
            "tokens"] == default_chat
        shorter = http.post("/tokenize", json={"messages": QUESTION,
                                               "add_generation_prompt": False}).json()
        assert shorter["tokens"] == default_chat[:shorter["count"]] < default_chat
    assert recording.threads == {"bcg-engine"}


@pytest.mark.parametrize("from_file", [True, False])
def test_the_servers_chat_template_renders_every_conversation(tmp_path, from_file):
    """--chat-template (a file, or the template itself) replaces the tokenizer's for chat
    completions and /tokenize's messages, and /tokenizer_info reports it."""
    require_builtin_model()
    from starlette.testclient import TestClient

    from bcg.config import EngineConfig
    from bcg.engine.llm_engine import LLMEngine
    from bcg.server.app import create_app
    from bcg.server.serve import ServerSettings

    template = "{% for m in messages %}Question: {{ m['content'] }}\nAnswer:{% endfor %}"
    given = template
    if from_file:
        given = str(tmp_path / "chat.jinja")
        (tmp_path / "chat.jinja").write_text(template)
    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN))
    expected = engine.tokenizer.encode("Question: What is the capital of France?\nAnswer:",
                                       add_special_tokens=False)
    app = create_app(engine, MODEL, ServerSettings(chat_template=given, disable_log_stats=True,
                                                   disable_access_log=True))
    with TestClient(app) as http:
        assert http.post("/tokenize", json={"messages": QUESTION}).json()["tokens"] == expected
        assert http.get("/tokenizer_info").json()["chat_template"] == template
        reply = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 2, "temperature": 0}).json()
        assert reply["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.parametrize("value,message", [
    ("missing.jinja", "chat_template 'missing.jinja' is neither a file nor a Jinja template"),
    (".", "chat_template '.' is neither a file"),  # a folder
])
def test_a_chat_template_that_is_no_template_is_refused(value, message):
    from bcg.server.serve import ServerSettings

    with pytest.raises(ValueError, match=message):
        ServerSettings(chat_template=value)


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe{{ messages }}", "cannot be read"), (b" \n", "is an empty file")])
def test_a_chat_template_file_that_is_no_template_is_refused(tmp_path, content, message):
    from bcg.server.serve import ServerSettings

    (tmp_path / "chat.jinja").write_bytes(content)
    with pytest.raises(ValueError, match=f"chat_template .* {message}"):
        ServerSettings(chat_template=str(tmp_path / "chat.jinja"))


def test_a_chat_template_is_a_file_first_as_vllm_reads_it(tmp_path):
    """A file whose path has braces is still a file; the settings keep the path (a copy
    reads it again) and the text apart."""
    from bcg.server.serve import ServerSettings

    path = tmp_path / "{model}.jinja"
    path.write_text("Plain text, no markup\n")
    settings = ServerSettings(chat_template=str(path))
    assert settings.chat_template_text == "Plain text, no markup\n"
    copy = dataclasses.replace(settings, disable_log_stats=True)
    assert (copy.chat_template, copy.chat_template_text) == (str(path), "Plain text, no markup\n")
    assert ServerSettings(chat_template="Hello\n").chat_template_text == "Hello\n"


def test_a_stream_the_client_leaves_before_its_first_event_is_aborted():
    """The client is gone before the response iterates its events: no generator `finally`
    runs, so the response itself aborts the requests."""
    import asyncio

    from bcg.server.app import _Run
    from bcg.server.protocol import CompletionRequest

    class Loop:
        aborted: list[list[str]] = []

        def abort(self, request_ids):
            Loop.aborted.append(request_ids)

    async def chunks():
        raise AssertionError("the stream was not expected to start")
        yield {}

    async def client_leaves_at_once():
        run = _Run(Loop(), CompletionRequest(model=MODEL, prompt="Hi"), MODEL, ["Hi"],
                   ["r0"], asyncio.Queue())
        response = run.stream(chunks())
        never = asyncio.Event()

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            await never.wait()  # the socket is gone: nothing is ever sent

        await response({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send)

    asyncio.run(client_leaves_at_once())
    assert Loop.aborted == [["r0"]]


def test_generated_tokens_count_only_outputs_that_added_one():
    """A scored prompt (max_tokens=0) finishes with no token: it adds none to the count."""
    import asyncio
    from types import SimpleNamespace

    from bcg.engine.outputs import CompletionOutput, RequestOutput
    from bcg.server.engine_loop import EngineLoop, _no_output_yet, _Route

    def output(request_id, token_ids, finished):
        return RequestOutput(request_id, None, [1, 2], [CompletionOutput(
            0, "", token_ids, "length" if finished else None)], finished)

    steps = [[output("gen", [5], False), output("scored", [], True)],
             [output("gen", [5, 6], True)]]
    blocks = SimpleNamespace(num_free_blocks=1, num_blocks=1)
    engine = SimpleNamespace(
        step=lambda: steps.pop(0), stats=SimpleNamespace(prefill_tokens=0),
        scheduler=SimpleNamespace(running=[], waiting=[], block_manager=blocks),
        runner=SimpleNamespace(forward_counts={}))
    loop = EngineLoop(engine)
    loop._loop = asyncio.new_event_loop()
    try:
        queue = asyncio.Queue()
        for index, request_id in enumerate(["gen", "scored"]):
            loop._routes[request_id] = _Route(queue, index, _no_output_yet(request_id, [1, 2]))
        loop._step()
        loop._step()
    finally:
        loop._loop.close()
    assert loop.snapshot.num_generation_tokens == 2

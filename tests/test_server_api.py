"""`bcg serve`'s fuller API on 127.0.0.1 with the built-in SmolLM2: every sampling field,
refused fields, logprobs and echo (as the openai client and lm-eval send them), vLLM's
extra routes, request limits, lone surrogates, logging, the port check and shutdown.

The server runs `serve()` with small `ServerSettings` (limits, a fast stats interval and a
short grace period) in a subprocess whose log goes to a file the tests read.
"""

import contextlib
import dataclasses
import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests.builtin_model import require_builtin_model
from tests.server_process import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    QUESTION,
    free_port,
    send_headers_only,
    wait_until_healthy,
)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

BODY_LIMIT = 65536
SEQUENCE_LIMIT = 8
EOS = 2  # SmolLM2's <|im_end|>
PROMPT_ID = 504  # an ordinary token of SmolLM2's
SERVER_SCRIPT = f"""
import logging, sys
from bcg.config import EngineConfig
from bcg.server.serve import ServerSettings, serve
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
settings = ServerSettings(max_request_body_bytes={BODY_LIMIT},
                          max_sequences_per_request={SEQUENCE_LIMIT},
                          graceful_shutdown_seconds=float(sys.argv[2]), log_stats_interval=0.5)
serve(EngineConfig(device="cpu", max_model_len={MAX_MODEL_LEN}), "127.0.0.1", int(sys.argv[1]),
      None, settings)
"""


class Server:
    def __init__(self, base: str, process: subprocess.Popen, log) -> None:
        self.base, self.process, self.log = base, process, log

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", json=body, timeout=60, **kwargs)

    def complete(self, **body) -> dict:
        response = self.post("/v1/completions", {"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, path: str, body: dict) -> list[dict]:
        """Every chunk of a streamed response."""
        with httpx.stream("POST", f"{self.base}{path}", json={**body, "stream": True},
                          timeout=60) as response:
            return [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                    if line.startswith("data: {")]

    def error(self, path: str, body: dict, status: int = 400) -> dict:
        response = self.post(path, body)
        assert response.status_code == status, response.text
        return response.json()["error"]

    def tokens(self, text: str) -> list[int]:
        return self.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()[
            "tokens"]


@contextlib.contextmanager
def started_server(graceful_shutdown_seconds: float):
    """A `bcg serve` process of the built-in model, stopped (SIGTERM) if still running."""
    require_builtin_model()
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(port), str(graceful_shutdown_seconds)],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, process, log)
        yield Server(base, process, log)
    finally:
        if process.poll() is None:  # the shutdown test stops it itself
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
    assert process.returncode == 0, f"the server exited with {process.returncode}"


@pytest.fixture(scope="module")
def server():
    with started_server(graceful_shutdown_seconds=1.0) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                         timeout=60)


# --- 1. sampling fields ------------------------------------------------------------------


def test_logit_bias_stop_token_ids_and_min_tokens_reach_the_engine(server):
    forced = server.tokens(" banana")[0]
    biased = server.complete(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                             logit_bias={str(forced): 100})["choices"][0]
    assert biased["logprobs"]["tokens"] == [" banana"] * 4
    stopped = server.complete(prompt=PROMPT, max_tokens=8, temperature=0,
                              logit_bias={str(forced): 100}, stop_token_ids=[forced])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["stop_reason"] == forced
    assert stopped["choices"][0]["text"] == ""  # vLLM's: the stop token's text left out
    assert stopped["usage"]["completion_tokens"] == 1
    kept = server.complete(prompt=PROMPT, max_tokens=8, temperature=0, stop_token_ids=[forced],
                           logit_bias={str(forced): 100}, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == " banana"

    eos_first = server.complete(prompt=PROMPT, max_tokens=8, temperature=0,
                                logit_bias={str(EOS): 100})
    assert eos_first["usage"]["completion_tokens"] == 1
    assert eos_first["choices"][0]["stop_reason"] is None
    special = server.complete(prompt=PROMPT, max_tokens=2, temperature=0, ignore_eos=True,
                              logit_bias={str(EOS): 100}, skip_special_tokens=False)
    assert special["choices"][0]["text"] == "<|im_end|>" * 2
    held_back = server.complete(prompt=PROMPT, max_tokens=8, temperature=0, min_tokens=4,
                                logit_bias={str(EOS): 100})
    assert held_back["choices"][0]["finish_reason"] == "stop"
    assert held_back["usage"]["completion_tokens"] == 5  # four, then the favoured EOS


def test_a_chat_stopped_by_a_string_names_it_in_stop_reason(server):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0,
            "stop": ["never-appears", "Paris"]}
    choice = server.post("/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "Paris"
    assert "Paris" not in choice["message"]["content"]
    kept = server.post("/v1/chat/completions", {**body, "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["message"]["content"] == choice["message"]["content"] + "Paris"
    chunks = server.stream("/v1/chat/completions", body)
    last = [c["choices"][0] for c in chunks if c["choices"]][-1]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "Paris"


def test_penalties_min_p_and_top_k_change_sampling(server):
    prompt = "a b a b a b a b"
    greedy = server.complete(prompt=prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    for field, value in [("presence_penalty", 2.0), ("frequency_penalty", 2.0),
                         ("repetition_penalty", 2.0)]:
        text = server.complete(prompt=prompt, max_tokens=8, temperature=0,
                               **{field: value})["choices"][0]["text"]
        assert text != greedy, field
    # Keeping only the likeliest token makes sampling at temperature 1 greedy.
    for field, value in [("min_p", 1.0), ("top_k", 1)]:
        sampled = server.complete(prompt=prompt, max_tokens=8, temperature=1.0, seed=3,
                                  **{field: value})["choices"][0]["text"]
        assert sampled == greedy, field


BAD_FIELDS = [
    ("presence_penalty", 3.0), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("min_p", 2.0), ("min_tokens", 100), ("stop_token_ids", [-1]), ("top_k", -2),
    ("logprobs", 21), ("prompt_logprobs", 21), ("seed", "7"), ("ignore_eos", "yes"),
    ("logit_bias", {"12": 1000}), ("logit_bias", {"x": 1}), ("logit_bias", {"99999999": 1}),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v}" for f, v in BAD_FIELDS])
def test_a_bad_sampling_field_is_named(server, field, value):
    error = server.error("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                             field: value})
    assert field in error["message"] and error["param"] == field


def test_chat_names_its_own_fields_for_sampling_errors(server):
    error = server.error("/v1/chat/completions", {"messages": QUESTION, "logprobs": True,
                                                  "top_logprobs": 21})
    assert error["param"] == "top_logprobs"
    error = server.error("/v1/chat/completions", {"messages": QUESTION,
                                                  "max_completion_tokens": -1})
    assert error["param"] == "max_completion_tokens"
    assert error["message"].startswith("max_completion_tokens must be")


WRONG_FORMS = [  # (path, body, param, message)
    ("/v1/completions", {"prompt": 123}, "prompt", "prompt: must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt", "one form for the whole list"),
    ("/v1/completions", {"prompt": ["a", [1, 2]]}, "prompt", "one form for the whole list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 123}]},
     "messages.0.content", "messages.0.content: must be a string or a list of text parts"),
    ("/v1/completions", {"prompt": "Hi", "stop": ""}, "stop", "non-empty strings"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "parts of type image_url are not supported: only text parts"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function"}]}]},
     "messages.1.tool_calls", "tool_calls are not supported"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "refusal": "no"}]},
     "messages.1.refusal", "refusal is not supported: send null"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]},
     "messages.0.content", "parts take only 'type' and 'text' here, got ['cache_control']"),
]


@pytest.mark.parametrize("path,body,param,message", WRONG_FORMS,
                         ids=[str(list(w[1].values())[-1]) for w in WRONG_FORMS])
def test_a_field_of_the_wrong_form_gets_one_message(server, path, body, param, message):
    error = server.error(path, {"model": MODEL, "max_tokens": 1, **body})
    assert message in error["message"] and error["param"] == param
    assert error["message"].count(";") == 0, "one message, not one per member of a union"


def test_a_body_that_is_not_utf8_is_named(server):
    response = httpx.post(f"{server.base}/v1/completions", content=b'{"prompt": "hi \xff\xfe"}',
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert "the body is not valid UTF-8 (byte 15)" in response.json()["error"]["message"]


def test_an_earlier_reply_sent_back_with_its_empty_tool_fields_is_taken(server):
    """SDKs send an assistant message back as they got it: its null or empty tool calls,
    refusal, function call and audio are no-op values, not unknown fields."""
    earlier = {"role": "assistant", "content": "Paris.", "tool_calls": [], "refusal": None,
               "function_call": None, "audio": None, "annotations": []}
    for tool_calls in ([], None):
        response = server.post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "messages": [
                *QUESTION, {**earlier, "tool_calls": tool_calls},
                {"role": "user", "content": "And Spain?"}]})
        assert response.status_code == 200, response.text


def test_values_nested_too_deeply_are_refused_by_name(server):
    """Deeper than the template's renderer (a recursive copy) or the JSON parser goes: a 400
    that says so, not an internal error."""
    deep = json.loads("[" * 600 + "]" * 600)
    error = server.error("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1,
                                                  "chat_template_kwargs": {"deep": deep}})
    assert "nested this deeply" in error["message"]
    body = '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    response = httpx.post(f"{server.base}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert "nested too deeply" in response.json()["error"]["message"]
    assert server.complete(prompt="Hi", max_tokens=1)["choices"]


def test_an_empty_prompt_of_a_batch_is_named_by_its_index(server):
    error = server.error("/v1/completions", {"prompt": ["Hi", ""], "max_tokens": 1})
    assert error["message"] == "prompt 1: the prompt is empty" and error["param"] == "prompt"


def test_completions_take_16_tokens_by_default_and_null_as_the_rest_of_the_context(server):
    """As in vLLM: max_tokens left out is 16; null is no cap but max_model_len."""
    prompt = [PROMPT_ID] * (MAX_MODEL_LEN - 5)
    error = server.error("/v1/completions", {"prompt": prompt})
    assert "max_tokens=16" in error["message"]
    rest = server.complete(prompt=prompt, max_tokens=None, ignore_eos=True, temperature=0)
    assert rest["usage"]["completion_tokens"] == 5
    assert rest["choices"][0]["finish_reason"] == "length"
    assert server.complete(prompt="Hi", ignore_eos=True)["usage"]["completion_tokens"] == 16


REFUSED = [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "and so on"}, "suffix"),
    ("/v1/completions", {"frobnicate": True}, "frobnicate"),
    ("/v1/completions", {"stream_options": {"continuous_usage_stats": True}, "stream": True},
     "continuous_usage_stats"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi", "tool_calls": []}]}, "tool_calls"),
]


@pytest.mark.parametrize("path,fields,name", REFUSED, ids=[r[2] for r in REFUSED])
def test_an_unimplemented_field_is_refused_by_name(server, path, fields, name):
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": QUESTION})
    error = server.error(path, {**body, **fields})
    assert name in error["message"] and name in error["param"]


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(server):
    """The default is max_model_len minus the prompt, which the engine accepts (a favoured
    EOS keeps the reply short)."""
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": QUESTION,
                                                "logit_bias": {str(EOS): 100}}).json()
    assert chat["choices"][0]["finish_reason"] == "stop"


def test_no_op_values_of_unimplemented_fields_are_accepted(server):
    server.complete(prompt="Hi", max_tokens=1, best_of=1, suffix=None, user="me",
                    temperature=None, top_p=None, n=None, stream=False,
                    skip_special_tokens=True, include_stop_str_in_output=False,
                    spaces_between_special_tokens=True)
    response = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": QUESTION, "max_tokens": 1, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "parallel_tool_calls": False, "echo": False,
        "add_generation_prompt": True, "continue_final_message": False, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    assert response.status_code == 200, response.text


def test_chat_continues_the_last_message_and_takes_template_variables(server):
    """vLLM's chat fields: continue_final_message (with add_generation_prompt false) goes on
    from an assistant message left open; chat_template_kwargs reach the template (SmolLM2's
    ignores enable_thinking); the two contradicting options are refused."""
    turns = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": turns, "max_tokens": 4, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    continued = server.post("/v1/chat/completions", body).json()
    assert continued["choices"][0]["message"]["content"].strip().startswith("Paris")
    tokens = server.post("/tokenize", {"messages": turns, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()["tokens"]
    assert continued["usage"]["prompt_tokens"] == len(tokens)
    thinking = server.post("/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert thinking.status_code == 200, thinking.text
    error = server.error("/v1/chat/completions", {"messages": turns, "max_tokens": 1,
                                                  "continue_final_message": True})
    assert "cannot both be true" in error["message"]
    assert error["param"] == "continue_final_message"
    for reserved in ({"messages": []}, {"chat_template": "x"}, {"tools": []},
                     {"add_generation_prompt": False}):
        for path in ("/v1/chat/completions", "/tokenize"):
            error = server.error(path, {"messages": QUESTION, "chat_template_kwargs": reserved})
            assert "may not set" in error["message"] and error["param"] == "chat_template_kwargs"
    error = server.error("/tokenize", {"prompt": "Hi", "continue_final_message": True})
    assert "apply to `messages` only" in error["message"]
    wrong_model = {"model": "gpt-9", "messages": turns, "continue_final_message": True}
    assert server.post("/v1/chat/completions", wrong_model).status_code == 404


def test_room_left_by_max_model_len_names_what_does_not_fit(server):
    error = server.error("/v1/completions", {"prompt": "Hi", "max_tokens": None,
                                             "min_tokens": MAX_MODEL_LEN})
    assert error["param"] == "min_tokens" and "is more than the" in error["message"]
    error = server.error("/v1/completions", {"prompt": [PROMPT_ID] * (MAX_MODEL_LEN + 1),
                                             "max_tokens": None})
    assert f"exceed max_model_len={MAX_MODEL_LEN}" in error["message"]


def test_the_model_may_be_left_out_and_an_unknown_one_is_not_found(server, client):
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    chat = server.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=1)


def test_an_assistant_message_may_have_null_content(server):
    turns = [QUESTION[-1], {"role": "assistant", "content": None}, QUESTION[-1]]
    response = server.post("/v1/chat/completions", {"messages": turns, "max_tokens": 1})
    assert response.status_code == 200, response.text
    error = server.error("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]})
    assert "a user message needs content" in error["message"]


def test_a_chat_beyond_the_context_names_the_messages_not_a_prompt_index(server):
    error = server.error("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 10**6})
    assert error["message"].startswith("the prompt's") and error["param"] == "messages"
    error = server.error("/v1/completions", {"prompt": ["Hi", "Hi"], "n": 2, "max_tokens": 10**6})
    assert error["message"].startswith("prompt 0: ") and error["param"] == "prompt"


# --- 2. logprobs and echo ------------------------------------------------------------------


def test_openai_client_logprobs_echo_penalties_and_streaming(server, client):
    full = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
        presence_penalty=0.5, frequency_penalty=0.5, seed=1,
        extra_body={"repetition_penalty": 1.1, "min_p": 0.01, "top_k": 40, "min_tokens": 2})
    choice = full.choices[0]
    logprobs = choice.logprobs
    prompt_tokens, completion_tokens = full.usage.prompt_tokens, full.usage.completion_tokens
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(logprobs.tokens) == prompt_tokens + completion_tokens
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i])
                                    for i in range(len(logprobs.tokens))]
    for token, lp, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                              logprobs.top_logprobs[1:], strict=True):
        assert top[token] == lp and 1 <= len(top) <= 3  # the token and up to 2 alternatives

    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
        presence_penalty=0.5, frequency_penalty=0.5, seed=1, stream=True,
        extra_body={"repetition_penalty": 1.1, "min_p": 0.01, "top_k": 40, "min_tokens": 2})
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.logprobs.tokens] == logprobs.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == logprobs.text_offset
    streamed = [lp for c in chunks for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)

    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content)
    for token in content:
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True)
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
        assert token.bytes == list(token.token.encode())
    chat_stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, stream=True)
    streamed_content = [t for c in chat_stream if c.choices and c.choices[0].logprobs
                        for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed_content] == [t.token for t in content]


def lm_eval_loglikelihood(choice: dict, context_length: int) -> tuple[float, bool]:
    """What lm-eval's local-completions backend makes of a choice (parse_logprobs)."""
    token_logprobs = choice["logprobs"]["token_logprobs"][context_length:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][context_length:-1]
    greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs,
                                                           strict=True))
    return sum(token_logprobs), greedy


def test_lm_eval_loglikelihood_requests(server):
    """lm-eval's payload: token-id prompts, echo, max_tokens 1, logprobs 1, temperature 0,
    a seed; it reads choices[i].index and the prompt's token logprobs."""
    context = server.tokens("Question: What is the capital of France?\nAnswer:")
    continuations = [server.tokens(" Paris"), server.tokens(" London")]
    prompts = [context + continuation for continuation in continuations]
    response = server.complete(prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                               temperature=0, seed=1234)
    choices = sorted(response["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    scores = []
    for choice, prompt in zip(choices, prompts, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(prompt) + 1  # the prompt's, then the generated one
        assert token_logprobs[0] is None and choice["logprobs"]["top_logprobs"][0] is None
        scores.append(lm_eval_loglikelihood(choice, len(context)))
    paris, london = scores
    assert paris[0] > london[0]

    scored_only = server.complete(prompt=prompts, echo=True, max_tokens=0, logprobs=1,
                                  temperature=0)
    for choice, full, prompt in zip(sorted(scored_only["choices"], key=lambda c: c["index"]),
                                    choices, prompts, strict=True):
        assert choice["text"] == full["text"][: len(choice["text"])]
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt)
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            full["logprobs"]["token_logprobs"][1: len(prompt)], abs=1e-3)
    assert scored_only["usage"]["completion_tokens"] == 0

    # The greedy token, scored as a continuation: lm-eval finds it greedy, with the
    # logprob it had when generated.
    generated = server.complete(prompt=[context], max_tokens=1, logprobs=0, temperature=0)
    token = generated["choices"][0]["logprobs"]["tokens"][0]
    rescored = server.complete(prompt=[context + server.tokens(token)[:1]], echo=True,
                               max_tokens=1, logprobs=1, temperature=0, seed=1234)
    loglikelihood, greedy = lm_eval_loglikelihood(rescored["choices"][0], len(context))
    assert greedy
    assert loglikelihood == pytest.approx(
        generated["choices"][0]["logprobs"]["token_logprobs"][0], abs=1e-3)


def test_prompt_logprobs_field(server):
    prompt = server.tokens(PROMPT)
    choice = server.complete(prompt=prompt, max_tokens=1, prompt_logprobs=1)["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    for token_id, position in zip(prompt[1:], choice["prompt_logprobs"][1:], strict=True):
        assert str(token_id) in position and 1 <= len(position) <= 2
        entry = position[str(token_id)]
        assert entry["logprob"] <= 0 and entry["rank"] >= 1 and entry["decoded_token"]
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": QUESTION,
                                                "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


# --- 3. vLLM's extra routes ------------------------------------------------------------


def test_tokenize_detokenize_version_and_tokenizer_info(server):
    import bcg

    tokenized = server.post("/tokenize", {"model": MODEL, "prompt": PROMPT,
                                          "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"])
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    assert server.post("/detokenize", {"tokens": tokenized["tokens"]}).json() == {
        "prompt": PROMPT}
    chat_tokens = server.post("/tokenize", {"messages": QUESTION}).json()
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": QUESTION,
                                                "max_tokens": 1}).json()
    assert chat_tokens["count"] == chat["usage"]["prompt_tokens"]
    without_reply_prompt = server.post("/tokenize", {"messages": QUESTION,
                                                     "add_generation_prompt": False}).json()
    assert without_reply_prompt["count"] < chat_tokens["count"]

    assert httpx.get(f"{server.base}/version", timeout=10).json() == {
        "version": bcg.__version__}
    info = httpx.get(f"{server.base}/tokenizer_info", timeout=10).json()
    assert info["tokenizer_class"] and "message" in info["chat_template"]
    assert info["eos_token_id"] == EOS and info["eos_token"] == "<|im_end|>"
    assert "bos_token_id" in info
    assert httpx.head(f"{server.base}/health", timeout=10).status_code == 200

    for path, body, name, status in [
        ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, "gpt-9", 404),  # vLLM's status
        ("/tokenize", {"prompt": "hi", "messages": QUESTION}, "messages", 400),
        ("/tokenize", {}, "prompt", 400),
        ("/detokenize", {"tokens": [10**9]}, "vocabulary", 400),
        ("/detokenize", {"tokens": "hi"}, "tokens", 400),
    ]:
        assert name in server.error(path, body, status)["message"]


# --- 4. limits ---------------------------------------------------------------------------


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    status, headers, body = send_headers_only(server.base, "/v1/completions", 10 * 2**20)
    assert status == 413 and headers["connection"] == "close"
    assert str(BODY_LIMIT) in body["error"]["message"]
    assert "--max-request-body-bytes" in body["error"]["message"]

    def chunks():  # no Content-Length: the limit counts the bytes as they arrive
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(8):
            yield b"a" * 16384
        yield b'"}'

    response = httpx.post(f"{server.base}/v1/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert server.complete(prompt="Hi", max_tokens=1)["choices"]


def test_too_many_sequences_in_one_request(server):
    error = server.error("/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3,
                                             "max_tokens": 1})
    assert "9" in error["message"] and str(SEQUENCE_LIMIT) in error["message"]
    assert "--max-sequences-per-request" in error["message"] and error["param"] == "n"
    at_the_limit = server.complete(prompt=["a", "b"], n=4, max_tokens=1)
    assert len(at_the_limit["choices"]) == SEQUENCE_LIMIT


def test_server_settings_are_checked():
    from bcg.server.serve import ServerSettings

    with pytest.raises(ValueError, match="max_request_body_bytes"):
        ServerSettings(max_request_body_bytes=0)
    with pytest.raises(ValueError, match="log_stats_interval must be a number > 0"):
        ServerSettings(log_stats_interval=0)
    assert ServerSettings(graceful_shutdown_seconds=0).graceful_shutdown_seconds == 0
    for bad in (-1, True, "5"):
        with pytest.raises(ValueError, match="graceful_shutdown_seconds must be a number >= 0"):
            ServerSettings(graceful_shutdown_seconds=bad)
    assert all(f.metadata["help"] for f in dataclasses.fields(ServerSettings))


# --- 5. lone surrogates --------------------------------------------------------------------


def test_a_lone_surrogate_is_refused_and_the_connection_kept(server):
    host, port = server.base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json"}
    bodies = [  # json.dumps writes a lone surrogate as a JSON escape, as clients do
        ("prompt", {"model": MODEL, "prompt": "x\ud800y", "max_tokens": 1}),
        ("prompt.1", {"model": MODEL, "prompt": ["ok", "\udfff"], "max_tokens": 1}),
        ("messages.0.content",
         {"model": MODEL, "messages": [{"role": "user", "content": "a\udc00"}]}),
    ]
    sockets = set()
    for param, body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        connection.request("POST", path, body=json.dumps(body), headers=headers)
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 400 and "surrogate" in error["message"]
        assert error["param"] == param
        assert response.getheader("connection") != "close"
        sockets.add(id(connection.sock))
    # The same surrogate as raw (CESU-8) bytes, which JSON decoding lets through too.
    connection.request("POST", "/v1/completions", headers=headers,
                       body=b'{"model": "%s", "prompt": "x\xed\xa0\x80y"}' % MODEL.encode())
    response = connection.getresponse()
    assert response.status == 400 and "surrogate" in json.loads(response.read())["error"][
        "message"]
    sockets.add(id(connection.sock))
    connection.request("POST", "/v1/completions", headers=headers,
                       body=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}))
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["choices"]
    sockets.add(id(connection.sock))
    connection.close()
    assert len(sockets) == 1, "the server closed the keep-alive connection"
    assert "Traceback" not in server.log_text()


# --- 7. logging ----------------------------------------------------------------------------


def test_access_and_throughput_log_lines(server):
    server.complete(prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    httpx.get(f"{server.base}/v1/models?x=1", timeout=10)
    expected = ("Avg generation throughput", '"GET /v1/models?x=1 HTTP/1.1" 200 OK')
    deadline = time.monotonic() + 10  # a request's access line is written after its response
    while (not all(text in server.log_text() for text in expected)
           and time.monotonic() < deadline):
        time.sleep(0.2)
    log = server.log_text()
    assert '"POST /v1/completions HTTP/1.1" 200 OK' in log
    assert '"GET /v1/models?x=1 HTTP/1.1" 200 OK' in log
    line = next(line for line in log.splitlines() if "Avg generation throughput" in line)
    for part in ("Avg prompt throughput", "tokens/s", "Running:", "Waiting:", "KV cache usage"):
        assert part in line
    access = next(line for line in log.splitlines() if "POST /v1/completions" in line)
    assert access.endswith(" ms")


# --- 8. the port check ---------------------------------------------------------------------


def test_a_busy_or_invalid_port_is_one_line_naming_it(monkeypatch):
    import bcg.engine.llm_engine
    from bcg.config import EngineConfig
    from bcg.server.serve import check_port, serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=str(port)) as busy:
            check_port("127.0.0.1", port)
        assert "\n" not in str(busy.value)

        def no_engine(*args, **kwargs):
            raise AssertionError("the engine was built before the port was checked")

        monkeypatch.setattr(bcg.engine.llm_engine.LLMEngine, "__init__", no_engine)
        with pytest.raises(ValueError, match=str(port)):
            serve(EngineConfig(device="cpu"), "127.0.0.1", port, None)
        cli = subprocess.run(
            [sys.executable, "-m", "bcg.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
             "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0
    assert str(port) in cli.stderr and "Traceback" not in cli.stderr + cli.stdout
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    for invalid in (99999, 0, -1):
        with pytest.raises(ValueError, match=str(invalid)):
            check_port("127.0.0.1", invalid)
    with pytest.raises(ValueError, match="no-such-host.invalid"):
        check_port("no-such-host.invalid", 8000)


# --- 6. shutdown (last: it stops the module's server) -----------------------------------


def requests_cut_by(server: Server, *signals: signal.Signals) -> tuple[list[dict], list[dict]]:
    """A long stream and a long plain request running when the server gets `signals` (a
    fraction of a second apart): the stream's chunks and the plain response."""
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    streamed: list[dict] = []
    full: list[dict] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", f"{server.base}/v1/completions", json={**long, "stream": True},
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line.removeprefix("data: ")))
                    started.set()

    def collect():
        full.append(server.post("/v1/completions", long).json())

    threads = [threading.Thread(target=stream), threading.Thread(target=collect)]
    for thread in threads:
        thread.start()
    assert started.wait(60), "the stream never started"
    for sig in signals:
        time.sleep(0.5)
        server.process.send_signal(sig)
    for thread in threads:
        thread.join(60)
    return streamed, full


def test_a_second_ctrl_c_aborts_requests_at_once_and_exits_cleanly():
    with started_server(graceful_shutdown_seconds=60.0) as server:
        start = time.monotonic()
        streamed, full = requests_cut_by(server, signal.SIGINT, signal.SIGINT)
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - start < 30, "the second SIGINT waited out the grace period"
        assert streamed[-1]["choices"][0]["finish_reason"] == "abort"
        assert full[0]["choices"][0]["finish_reason"] == "abort"
        log = server.log_text()
        assert "SIGINT again: aborting the requests in flight now" in log
        assert "Traceback" not in log and "terminate called" not in log


def test_shutdown_ends_streams_and_responses_with_abort(server):
    streamed, full = requests_cut_by(server, signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
    assert streamed[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0]["finish_reason"] is None for c in streamed[:-1])
    assert full[0]["choices"][0]["finish_reason"] == "abort"
    assert 0 < full[0]["usage"]["completion_tokens"] < 400
    log = server.log_text()
    assert "SIGTERM: shutting down" in log and "server stopped" in log
    assert "Traceback" not in log

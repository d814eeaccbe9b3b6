"""Start the engine and run the app under uvicorn until SIGINT/SIGTERM.

The port is checked before the model loads, so a busy or invalid one is a one-line error
at once. On a signal uvicorn stops accepting connections and in-flight requests may finish
for `ServerSettings.graceful_shutdown_seconds`; then whatever is left is aborted (its
clients get complete responses with finish_reason 'abort'), the engine thread stops and the
process exits 0. A failed tensor-parallel rank stops the server too (the engine cannot step
again): the error is logged and the process exits non-zero.

Logging follows vLLM's server: a line per HTTP request (`bcg.server.access`), a throughput
line every few seconds while requests are in flight, and a line at shutdown, all at INFO on
the `bcg.server` logger, which `serve` enables whatever the root logger's level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass

from bcg.config import EngineConfig, flag_field
from bcg.loader.builtin import BUILTIN_NAME
from bcg.utils import is_int, is_number

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """`bcg serve`'s own settings (a flag each, like `EngineConfig`'s fields)."""

    max_request_body_bytes: int = flag_field(
        8 * 2**20, "largest request body in bytes; a larger one gets 413 before it is read "
        "(default: 8 MiB)")
    max_sequences_per_request: int = flag_field(
        256, "most sequences one request may ask for (prompts x n); more get 400")
    graceful_shutdown_seconds: float = flag_field(
        5.0, "on SIGINT/SIGTERM, how long requests in flight may finish before they are "
        "aborted (their responses end with finish_reason 'abort')")
    log_stats_interval: float = flag_field(
        5.0, "seconds between throughput log lines (prompt and generation tokens/s, running "
        "and waiting requests, KV cache use) while requests are in flight")
    chat_template: str | None = flag_field(
        None, "a Jinja chat template for chat requests and /tokenize's messages instead of "
        "the tokenizer's own: a file, or the template itself")
    disable_log_stats: bool = flag_field(False, "no throughput log lines")
    disable_access_log: bool = flag_field(False, "no log line per HTTP request",
                                        aliases=("--disable-uvicorn-access-log",))

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_sequences_per_request"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        value = self.graceful_shutdown_seconds  # 0: abort at once
        if not (is_number(value) and value >= 0):
            raise ValueError(f"graceful_shutdown_seconds must be a number >= 0, got {value!r}")
        value = self.log_stats_interval
        if not (is_number(value) and value > 0):
            raise ValueError(f"log_stats_interval must be a number > 0, got {value!r}")
        self.chat_template_text = None  # chat_template's text (not a field: no flag of its own)
        if self.chat_template is not None:
            from bcg.engine.chat import read_chat_template  # transformers: not for --help

            self.chat_template_text = read_chat_template(self.chat_template)


def check_port(host: str, port: int) -> None:
    """Raise a one-line ValueError naming the port if the server could not listen on
    `host:port` (out of range, host unknown, or the port taken): a bind test, done before
    the model loads."""
    if not (is_int(port) and 1 <= port <= 65535):
        raise ValueError(f"port {port} is not a valid TCP port: pick one in 1-65535 (--port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(f"cannot listen on {host}:{port}: host {host!r} is unknown "
                         f"({error}) (--host)") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as error:
            reason = error.strerror or str(error)
            raise ValueError(f"cannot listen on {host}:{port}: {reason} (is another server "
                             f"using port {port}? pick another with --port)") from None


def serve(config: EngineConfig, host: str, port: int, served_model_name: str | None,
          settings: ServerSettings | None = None) -> None:
    settings = settings or ServerSettings()
    if served_model_name is not None and not served_model_name.strip():
        raise ValueError(f"--served-model-name {served_model_name!r} is blank: give the name "
                         "clients send as `model`, or leave the flag out (the model's own name)")
    check_port(host, port)
    try:
        import uvicorn

        from bcg.server.app import create_app
    except ImportError as error:
        raise ValueError(f"bcg serve needs {error.name}: pip install -e '.[server]'") from error
    from bcg.engine.llm_engine import LLMEngine

    _enable_server_logs()
    engine = LLMEngine(config)
    try:
        model_name = served_model_name or config.model or BUILTIN_NAME
        app = create_app(engine, model_name, settings)
        logger.info("serving %s on http://%s:%d/v1", model_name, host, port)
        server_config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=max(1, round(2 * settings.graceful_shutdown_seconds)))
        server = _server_exiting_cleanly(uvicorn.Server)(server_config)
        engine_loop = app.state.engine_loop
        engine_loop.on_fatal = lambda: setattr(server, "should_exit", True)
        server.run()
        if engine_loop.fatal is not None:  # a tensor-parallel rank failed: exit non-zero
            raise engine_loop.fatal
    finally:
        engine.close()  # the tensor-parallel workers end with the server


def _enable_server_logs() -> None:
    """INFO lines of `bcg.server.*`, through the root logger's handler (one is added if
    the root logger has none)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    server_logger = logging.getLogger("bcg.server")
    if server_logger.getEffectiveLevel() > logging.INFO:
        server_logger.setLevel(logging.INFO)


def _server_exiting_cleanly(server_class: type) -> type:
    """uvicorn's Server, except that a SIGINT/SIGTERM aborts the requests still running
    after the grace period, a second one aborts them at once, and the process then exits 0
    (uvicorn would re-raise the signal and die of it). Only a third signal stops the process
    where it stands: uvicorn's forced exit cancels the requests' tasks mid-flight (their
    clients get cut-off responses) and leaves the engine thread running into interpreter
    exit, which aborts the process."""

    class Server(server_class):
        signals_seen = 0

        def handle_exit(self, sig, frame) -> None:
            self.signals_seen += 1
            name, engine_loop = signal.Signals(sig).name, self.config.app.state.engine_loop
            if self.signals_seen == 1:
                grace = self.config.app.state.settings.graceful_shutdown_seconds
                snap = engine_loop.snapshot
                logger.info("%s: shutting down; %d requests in flight get %.1f s to finish, "
                            "then are aborted (send it again to abort them now)", name,
                            snap.num_running + snap.num_waiting, grace)
                timer = threading.Timer(grace, engine_loop.end_all)
                timer.daemon = True
                timer.start()
                # not uvicorn's handle_exit: after a failed rank has set should_exit, it would
                # take this first signal for a second one and force the exit
                self.should_exit = True
            elif self.signals_seen == 2:
                logger.info("%s again: aborting the requests in flight now (a third one exits "
                            "at once)", name)
                engine_loop.end_all()
            else:
                logger.warning("%s a third time: exiting without finishing the shutdown", name)
                os._exit(128 + sig)

        @contextlib.contextmanager
        def capture_signals(self):
            signals = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server

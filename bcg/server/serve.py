"""Start the engine and run the app under uvicorn until SIGINT/SIGTERM.

On a signal uvicorn stops accepting connections and in-flight requests may finish for
`GRACEFUL_SHUTDOWN_SECONDS`; then whatever is left is aborted (its clients get complete
responses with finish_reason 'stop'), the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from bcg.config import EngineConfig
from bcg.loader.builtin import BUILTIN_NAME

GRACEFUL_SHUTDOWN_SECONDS = 5

logger = logging.getLogger(__name__)


def serve(config: EngineConfig, host: str, port: int, served_model_name: str | None) -> None:
    try:
        import uvicorn

        from bcg.server.app import create_app
    except ImportError as error:
        raise ValueError(f"bcg serve needs {error.name}: pip install -e '.[server]'") from error
    from bcg.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    model_name = served_model_name or config.model or BUILTIN_NAME
    app = create_app(engine, model_name)
    logger.warning("serving %s on http://%s:%d/v1", model_name, host, port)
    server_config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=2 * GRACEFUL_SHUTDOWN_SECONDS)
    _server_exiting_cleanly(uvicorn.Server)(server_config).run()


def _server_exiting_cleanly(server_class: type) -> type:
    """uvicorn's Server, except that a SIGINT/SIGTERM aborts the requests still running
    after the grace period, and the process then exits 0 (uvicorn would re-raise the signal
    and die of it)."""

    class Server(server_class):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                end_all = self.config.app.state.engine_loop.end_all
                timer = threading.Timer(GRACEFUL_SHUTDOWN_SECONDS, end_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

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

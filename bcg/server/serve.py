"""Start the engine and run the app under uvicorn until SIGINT/SIGTERM.

On a signal uvicorn stops accepting connections, lets in-flight requests finish for up to
`GRACEFUL_SHUTDOWN_SECONDS`, then the app's shutdown aborts whatever is left and stops the
engine thread.
"""

from __future__ import annotations

import contextlib
import logging
import signal

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
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    _server_exiting_cleanly(uvicorn.Server)(config).run()


def _server_exiting_cleanly(server_class: type) -> type:
    """uvicorn's Server, except that after a graceful shutdown on SIGINT/SIGTERM the process
    exits with status 0 (uvicorn re-raises the signal, which kills the process with it)."""

    class Server(server_class):
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

"""`bcg serve` as a subprocess on 127.0.0.1 with the built-in SmolLM2 (CPU), for tests."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bcg.utils import free_port

STARTUP_SECONDS = 120
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
PROMPT = "The days of the week are Monday,"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@contextmanager
def running_server(args: list[str]) -> Iterator[str]:
    """Start `bcg serve --device cpu ARGS` on a free port; yield its base URL; on exit stop
    it with SIGTERM and check that it exits 0."""
    port = free_port()
    # A file, not a pipe: a pipe nobody reads fills up with log lines and blocks the server.
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "bcg.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
         "--port", str(port), *args],
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, process, log)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert code == 0, f"the server exited with {code} on SIGTERM"


def wait_until_healthy(base: str, process: subprocess.Popen, log) -> None:
    import httpx

    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited at start-up:\n{log.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    pytest.fail(f"the server was not healthy within {STARTUP_SECONDS} s")


def send_headers_only(base: str, path: str, content_length: int) -> tuple[int, dict, dict]:
    """POST headers that announce a body of `content_length` bytes, send none of it, and
    read what the server answers (it must answer without waiting for the body)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {content_length}\r\n\r\n".encode())
        received = b""
        while chunk := sock.recv(65536):  # the server closes the connection after a 413
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    headers = dict(line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:])
    return status, headers, json.loads(body)

"""Serving load test: `bcg serve` under Poisson arrivals, measured from the client side.

Starts its own server (dummy `qwen3-0.6b`, graphs on, by default), sends a fixed number of
streaming /v1/completions requests whose arrivals are a Poisson process at `--rate`
requests/s, with prompt and output lengths uniform in the given ranges (token-id prompts,
`ignore_eos`, fixed seed), and reports request and token throughput, time to first token
(TTFT) and inter-token latency (ITL) p50/p99. Every SSE chunk carries one new token.
Table + JSON in bench/results/. Run: python bench/bench_serving.py [--rate 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, require_cuda, write_results  # noqa: E402

from bcg.utils import free_port  # noqa: E402

STARTUP_SECONDS = 600
REQUEST_TIMEOUT_SECONDS = 600
VOCAB_FLOOR = 100  # prompt token ids are drawn from [VOCAB_FLOOR, 10000): no special tokens


@dataclass
class Result:
    prompt_len: int
    start: float
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--rate", type=float, default=16.0, help="mean arrivals per second")
    parser.add_argument("--input-len", default="64,1024", help="min,max prompt tokens")
    parser.add_argument("--output-len", default="32,512", help="min,max generated tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="--max-model-len 2048",
                        help="more `bcg serve` flags, e.g. '--decode-graph breakable'")
    parser.add_argument("--label", default="",
                        help="suffix of the JSON name, e.g. 'before' for a run of another "
                        "checkout (`PYTHONPATH=<checkout> python bench/bench_serving.py`)")
    return parser.parse_args()


def workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt token ids, output tokens) per request."""
    rng = random.Random(args.seed)
    in_lo, in_hi = map(int, args.input_len.split(","))
    out_lo, out_hi = map(int, args.output_len.split(","))
    arrival, requests = 0.0, []
    for _ in range(args.num_requests):
        arrival += rng.expovariate(args.rate)
        prompt = [rng.randrange(VOCAB_FLOOR, 10000) for _ in range(rng.randint(in_lo, in_hi))]
        requests.append((arrival, prompt, rng.randint(out_lo, out_hi)))
    return requests


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "bcg.cli", "serve", "--model", args.model,
               "--load-format", args.load_format, "--port", str(port),
               *args.server_args.split()]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"bench_serving: the server exited at start-up ({process.returncode})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(1)
    process.kill()
    sys.exit(f"bench_serving: the server was not healthy within {STARTUP_SECONDS} s")


async def send(client: httpx.AsyncClient, model: str, prompt: list[int],
               max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    result = Result(len(prompt), time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode()
                return result
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    result.chunk_times.append(time.perf_counter())
    except httpx.HTTPError as error:
        result.error = repr(error)
    return result


async def run_load(base: str, model: str, requests) -> tuple[list[Result], float]:
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_SECONDS,
                                 limits=httpx.Limits(max_connections=None)) as client:
        await send(client, model, requests[0][1], 8)  # warm-up
        start = time.perf_counter()

        async def arrive(at: float, prompt: list[int], max_tokens: int) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send(client, model, prompt, max_tokens)

        results = await asyncio.gather(*(arrive(*r) for r in requests))
        return list(results), time.perf_counter() - start


def summarize(results: list[Result], seconds: float) -> dict:
    done = [r for r in results if r.error is None and r.chunk_times]
    ttfts = [r.ttft * 1e3 for r in done]
    itls = [gap * 1e3 for r in done for gap in r.itls]
    generated = sum(len(r.chunk_times) for r in done)
    prompt = sum(r.prompt_len for r in done)
    return {
        "requests": len(results), "failed": len(results) - len(done), "seconds": seconds,
        "requests_per_s": len(done) / seconds, "output_tok_per_s": generated / seconds,
        "total_tok_per_s": (generated + prompt) / seconds,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
        "ttft_p99_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
        "itl_p50_ms": float(np.percentile(itls, 50)) if itls else None,
        "itl_p99_ms": float(np.percentile(itls, 99)) if itls else None,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def main() -> None:
    require_cuda("bench_serving")
    args = parse_args()
    port = free_port()
    server = start_server(args, port)
    try:
        results, seconds = asyncio.run(run_load(f"http://127.0.0.1:{port}", args.model,
                                                workload(args)))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    summary = summarize(results, seconds)
    print_table(f"bcg serve, {args.model} ({args.load_format}), {args.num_requests} requests "
                f"at {args.rate}/s, prompt {args.input_len}, output {args.output_len}",
                ["req/s", "out tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms",
                 "ITL p50 ms", "ITL p99 ms", "failed"],
                [[summary[k] for k in ("requests_per_s", "output_tok_per_s", "total_tok_per_s",
                                       "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                       "itl_p99_ms", "failed")]])
    label = f"_{args.label}" if args.label else ""
    write_results(f"bench_serving_{args.model}{label}", {"args": vars(args), **summary})


if __name__ == "__main__":
    main()

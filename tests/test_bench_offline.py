"""bench_offline's CPU-side logic: the workload and how a row counts its tokens."""

import importlib

import pytest

bench_offline = importlib.import_module("bench.bench_offline")


def test_the_workload_is_nano_vllms_and_unchanged():
    """256 requests with lengths in [100, 1024]; the README's numbers were measured on these
    totals, so a change to the workload shows here."""
    requests = bench_offline.workload(vocab=151936)
    assert len(requests) == 256
    assert all(100 <= len(p) <= 1024 and 100 <= n <= 1024 for p, n in requests)
    assert sum(len(p) for p, _ in requests) == 145822
    assert bench_offline.output_tokens(requests) == 145950


def test_a_row_counts_output_tokens_as_nano_vllm():
    """Output tok/s is the requests' max_tokens over the run's wall time; tok/s adds the
    prompts."""
    requests = [([1, 2, 3], 5), ([4], 7)]
    row = bench_offline.throughput_row("m", "eager", requests, {"generated": 12, "seconds": 2.0})
    assert row["model"] == "m" and row["mode"] == "eager" and row["requests"] == 2
    assert row["output_tok_s"] == 6.0
    assert row["tokens_per_s"] == 8.0


def test_a_run_that_fell_short_of_max_tokens_is_an_error():
    """A run that stopped early would make the max_tokens count overstate its rate."""
    with pytest.raises(RuntimeError, match="asked for 12"):
        bench_offline.throughput_row("m", "eager", [([1], 5), ([2], 7)],
                                     {"generated": 11, "seconds": 1.0})

"""bench_decode's CPU-side logic: time per output token from two `generate` timings."""

import importlib

import pytest

bench_decode = importlib.import_module("bench.bench_decode")


def test_tpot_is_the_time_after_the_first_token_per_later_token(monkeypatch):
    """T(1) = 50 ms to the first token, then 2 ms per token: tpot 2 ms, ttft 50 ms."""

    def fake_generate_seconds(llm, batch, max_tokens, seed):
        return 0.050 + 0.002 * (max_tokens - 1)

    monkeypatch.setattr(bench_decode, "generate_seconds", fake_generate_seconds)
    tpot_s, ttft_s = bench_decode.tpot(llm=None, batch=1)
    assert tpot_s == pytest.approx(0.002)
    assert ttft_s == pytest.approx(0.050)


def test_prompts_of_other_seeds_share_no_prefix():
    """Fresh prompts per call, so no timed prefill is shortened by a prefix-cache hit."""
    first = bench_decode.prompts(8, "first 8 0")
    whole = bench_decode.prompts(8, "whole 8 0")
    assert all(len(p) == bench_decode.PROMPT_LEN for p in first + whole)
    assert len({p[0] for p in first + whole}) == 16


def test_each_mode_names_its_steps_for_this_checkout():
    """This checkout has overlapped steps: every mode says whether its steps overlap."""
    for mode, args in bench_decode.MODES.items():
        assert bench_decode.engine_args(mode) == args
    assert bench_decode.engine_args("full graph, overlapped")["overlap"] is True


@pytest.mark.parametrize("overlap", [False, True])
def test_every_request_decodes_through_the_timed_steps(overlap, monkeypatch):
    """With chunked prefill the first request decodes steps before the last one starts; none
    may finish inside the timed window (the batch would shrink). On the CPU, stack replaced."""
    bench_host = importlib.import_module("bench.bench_host")
    monkeypatch.setattr(bench_decode, "DECODE_STEPS", 4)
    engine = bench_host.engine_for("qwen3-0.6b", "cpu", overlap, max_batch=8)
    engine.config.max_num_batched_tokens = 300  # prefill in several chunks
    engine.scheduler.max_num_batched_tokens = 300
    reasons = []
    finish = engine.scheduler.finish
    monkeypatch.setattr(engine.scheduler, "finish",
                        lambda seq, reason: reasons.append(reason) or finish(seq, reason))
    try:
        assert bench_decode.measure(engine, 8) > 0
        assert set(reasons) == {"abort"}
    finally:
        engine.close()

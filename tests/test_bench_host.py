"""bench_host on the CPU: the host path of a decode step, plain and overlapped, with the
stack replaced by a static output."""

import importlib

import pytest

bench_host = importlib.import_module("bench.bench_host")


@pytest.mark.parametrize("overlap", [False, True])
def test_host_path_steps_every_request_and_frees_its_blocks(overlap, monkeypatch):
    monkeypatch.setattr(bench_host, "STEPS", 4)
    engine = bench_host.engine_for("qwen3-0.6b", "cpu", overlap, max_batch=4)
    try:
        assert bench_host.host_ms_per_step(engine, 4) > 0
        assert not engine.scheduler.has_unfinished()
        manager = engine.scheduler.block_manager
        assert manager.num_free_blocks == engine.runner.num_kv_blocks
    finally:
        engine.close()

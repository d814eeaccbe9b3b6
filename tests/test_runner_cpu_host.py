"""The CPU KV cache and a hybrid's state slots sized to the memory budget, and the warning
when cores are fought over."""

import gc
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from bcg.config import EngineConfig
from bcg.forward import KVCache, MambaStateCache
from bcg.loader.model_source import resolve_model
from bcg.models.config import ModelConfig
from bcg.models.presets import PRESETS
from bcg.runner import host
from bcg.runner.graph_runner import frozen_gc
from bcg.runner.model_runner import ModelRunner
from tests.hf_tiny import SIZES, save_tiny_model

CONTEXT = SIZES["max_position_embeddings"]  # 256
BLOCK = 16
# The tiny llama's KV per block: 2 (K, V) x 2 layers x 16 tokens x 2 heads x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4


def saved_tiny_model(tmp_path_factory, arch: str):
    folder = tmp_path_factory.mktemp(arch)
    save_tiny_model(arch, folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "llama")


def runner(folder, monkeypatch, available: int | None, max_model_len=CONTEXT,
           **engine_args) -> ModelRunner:
    monkeypatch.setattr(host, "available_memory_bytes", lambda: available)
    config = EngineConfig(model=str(folder), device="cpu", **engine_args)
    return ModelRunner(config, resolve_model(str(folder)), max_model_len)


def test_block_bytes_as_assumed():
    assert KVCache.bytes_per_block(2, BLOCK, 2, 16, torch.float32) == BLOCK_BYTES


def test_plenty_of_memory_holds_the_whole_context(tiny, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="bcg.runner.model_runner"):
        r = runner(tiny, monkeypatch, available=2**34)
    assert r.num_kv_blocks * BLOCK == CONTEXT and r.max_model_len == CONTEXT
    gib = CONTEXT // BLOCK * BLOCK_BYTES / 2**30
    assert f"KV cache: 16 blocks of 16 tokens (256 tokens, {gib:.2f} GiB)" in caplog.text


def test_a_kv_cache_asked_for_beyond_memory_is_refused_with_what_fits(tiny, monkeypatch):
    """kv_cache_tokens within 90% of the available memory (what a max_model_len the user set
    may take) is allocated, past the default budgets; beyond it, an error names what fits
    instead of the allocator's failure."""
    available = 40 * BLOCK_BYTES  # 90%: 36 blocks
    assert runner(tiny, monkeypatch, available, kv_cache_tokens=36 * BLOCK).num_kv_blocks == 36
    with pytest.raises(ValueError, match=rf"kv_cache_tokens=1000000 needs .* GiB of KV cache a "
                                         rf"rank, more than .*lower kv_cache_tokens \(to "
                                         rf"{36 * BLOCK} or less\)"):
        runner(tiny, monkeypatch, available, kv_cache_tokens=1_000_000)


def test_a_default_context_too_large_for_memory_is_lowered(tiny, monkeypatch, caplog):
    """25% of the available memory holds 6 blocks: max_model_len falls to 96 tokens."""
    with caplog.at_level(logging.WARNING):
        r = runner(tiny, monkeypatch, available=4 * 6 * BLOCK_BYTES + 100)
    assert r.num_kv_blocks == 6 and r.max_model_len == 96
    [record] = [r for r in caplog.records if "lowered" in r.message]
    assert "256 to 96 tokens" in record.message and "GiB" in record.message


def test_the_default_cache_is_at_most_4_gib(monkeypatch):
    """qwen3-0.6b's 40960-token context is 8.75 GiB in fp32: capped at 4 GiB however much
    memory there is (sized without loading the model)."""
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 2**40)
    r = ModelRunner.__new__(ModelRunner)
    r.device, r.dtype, r.block_size = torch.device("cpu"), torch.float32, BLOCK
    r.model_config = ModelConfig.from_hf_dict(PRESETS["qwen3-0.6b"])
    r.num_kv_heads = r.model_config.num_key_value_heads
    r.state_cache = None
    blocks = r._num_kv_blocks(EngineConfig(device="cpu"), 40960, 0)
    assert blocks * r._kv_block_bytes() <= 4 * 2**30 < 40960 // BLOCK * r._kv_block_bytes()
    assert blocks * r._kv_block_bytes() > 3.99 * 2**30
    asked = r._num_kv_blocks(EngineConfig(device="cpu", max_model_len=40960), 40960, 0)
    assert asked == 40960 // BLOCK  # asked for: honoured while 90% of memory holds it


def test_an_asked_for_max_model_len_gets_its_cache_or_a_clear_error(tiny, monkeypatch):
    # 25% of memory holds 6 blocks, 90% holds 21: the asked-for 256 tokens (16 blocks) fit.
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 4 * 6 * BLOCK_BYTES + 100)
    config = EngineConfig(model=str(tiny), device="cpu", max_model_len=CONTEXT)
    r = ModelRunner(config, resolve_model(str(tiny)), CONTEXT)
    assert r.num_kv_blocks == 16 and r.max_model_len == CONTEXT
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 10 * BLOCK_BYTES)
    with pytest.raises(ValueError, match=r"KV cache holds 144 tokens \(0\.00 GiB\), fewer than "
                                         r"max_model_len=256: .*90% of the .* lower "
                                         r"max_model_len \(to 144 or less\)"):
        ModelRunner(config, resolve_model(str(tiny)), CONTEXT)
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 0)
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        ModelRunner(EngineConfig(model=str(tiny), device="cpu"), resolve_model(str(tiny)),
                    CONTEXT)


# The tiny hybrid (hf_tiny): 3 Mamba layers, each slot holding 3 x 128 conv inputs and an
# 8 x 8 x 16 SSM state in fp32; its one attention layer's KV block, 2 heads of 16.
SLOT_BYTES = 3 * (3 * 128 * 4 + 8 * 8 * 16 * 4)
HYBRID_BLOCK_BYTES = 2 * 1 * BLOCK * 2 * 16 * 4


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "nemotron_h")


def test_state_slots_and_kv_cache_share_the_budget(tiny_hybrid, monkeypatch, caplog):
    """25% of memory holds the context's KV (16 blocks) and 4.5 slots: 8 sequences' slots
    are refused with how many fit; 4 fit and are logged beside the KV cache."""
    available = 4 * (16 * HYBRID_BLOCK_BYTES + SLOT_BYTES * 9 // 2)
    with pytest.raises(ValueError, match=r"max_num_seqs=8 Mamba state slots \(0\.0 MiB each.*"
                                         r"256 tokens of KV cache .*lower max_num_seqs to 4 or "
                                         r"less, or lower max_model_len"):
        runner(tiny_hybrid, monkeypatch, available, block_size=BLOCK, max_num_seqs=8)
    with caplog.at_level(logging.INFO, logger="bcg.runner.model_runner"):
        r = runner(tiny_hybrid, monkeypatch, available, block_size=BLOCK, max_num_seqs=4)
    assert r.num_state_slots == 4 and r.num_kv_blocks == 16
    assert "KV cache: 16 blocks of 16 tokens (256 tokens, 0.00 GiB); Mamba state cache: 4 " \
           "slots (0.00 GiB)" in caplog.text


def test_state_slots_on_a_gpu_are_refused_past_gpu_memory_utilization(monkeypatch):
    """nemotron-h-8b (bf16, a slot ~97 MiB) on an 80 GiB GPU with 16 GiB in use: at 30% the
    256 default slots do not fit beside 8192 tokens of KV; the error says how many do."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (64 * 2**30, 80 * 2**30))
    r = ModelRunner.__new__(ModelRunner)
    r.device, r.dtype, r.block_size = torch.device("cuda"), torch.bfloat16, BLOCK
    r.model_config = ModelConfig.from_hf_dict(PRESETS["nemotron-h-8b"])
    r.num_kv_heads = r.model_config.num_key_value_heads
    slot = MambaStateCache.bytes_per_slot(24, 4, 128 * 64 + 2 * 8 * 128, 128, 64, 128,
                                          torch.bfloat16)
    assert 97 * 2**20 < slot < 98 * 2**20
    kv = 8192 // BLOCK * r._kv_block_bytes()
    fit = (8 * 2**30 - kv) // slot
    config = EngineConfig(device="cpu", gpu_memory_utilization=0.3)  # r.device is CUDA
    with pytest.raises(ValueError, match=rf"max_num_seqs=256 Mamba state slots \(97\.4 MiB each, "
                                         rf"24\.35 GiB\).*8\.00 GiB left.*lower max_num_seqs to "
                                         rf"{fit} or less, or raise gpu_memory_utilization"):
        r._check_state_slots_fit(config, 8192, slot)
    r._check_state_slots_fit(EngineConfig(device="cpu", gpu_memory_utilization=0.3,
                                          max_num_seqs=fit), 8192, slot)


def test_the_kv_budget_is_what_the_state_slots_leave(monkeypatch):
    """Slots already allocated count back into the available memory, out of the budget."""
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 7 * 2**30)
    assert host.cpu_kv_cache_budget(asked=False, taken=2**30)[0] == 2**30  # 25% of 8, less 1
    assert host.cpu_kv_cache_budget(asked=True, taken=2**30)[0] == int(0.9 * 8 * 2**30) - 2**30


def test_kv_cache_tokens_wins(tiny, monkeypatch):
    """Over the default budget (25% of memory: 17 blocks here), while memory holds it."""
    r = runner(tiny, monkeypatch, available=70 * BLOCK_BYTES, kv_cache_tokens=1000)
    assert r.num_kv_blocks == 63


def test_unknown_memory_falls_back_to_4_gib(tiny, monkeypatch):
    r = runner(tiny, monkeypatch, available=None)
    assert r.num_kv_blocks * BLOCK == CONTEXT
    assert host.cpu_kv_cache_budget(asked=False)[0] == 4 * 2**30


def test_budget_is_a_share_of_available_memory(monkeypatch):
    assert host.available_memory_bytes() > 0
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 8 * 2**30)
    assert host.cpu_kv_cache_budget(asked=False)[0] == 2 * 2**30
    assert host.cpu_kv_cache_budget(asked=True)[0] == int(0.9 * 8 * 2**30)
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 64 * 2**30)
    assert host.cpu_kv_cache_budget(asked=False)[0] == 4 * 2**30


def test_too_many_torch_threads_are_named(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores + 3)
    monkeypatch.setattr(host, "_others_busy_cores", lambda cores, seconds: 0.0)
    message = host.cores_contention()
    assert f"torch runs {cores + 3} threads" in message and "sched_getaffinity" in message
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert host.cores_contention() is None


def test_tensor_parallel_ranks_on_too_few_cores_are_named_not_blamed_on_others(monkeypatch):
    monkeypatch.setattr(host, "_affinity", lambda: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(host, "_others_busy_cores", lambda cores, seconds: 1.8)  # the ranks
    message = host.cores_contention(ranks=3)
    assert "tensor parallel size 3 runs 3 processes of 1 torch thread on 2 cores" in message
    assert "other processes" not in message
    assert host.cores_contention(ranks=2) is None


def test_other_processes_busy_on_our_cores_are_seen():
    cores = sorted(os.sched_getaffinity(0))
    spin = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin, str(core)]) for core in cores]
    try:
        time.sleep(0.5)
        message = host.cores_contention(sample_seconds=0.3)
    finally:
        for process in spinners:
            process.kill()
            process.wait()
    assert message is not None and "other processes keep" in message


def test_the_warning_is_one_line_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(host, "_cores_checked", False)
    monkeypatch.setattr(host, "cores_contention", lambda ranks: "CPU cores are oversubscribed: x")
    with caplog.at_level(logging.WARNING, logger="bcg.runner.host"):
        host.warn_if_cores_contended()
        host.warn_if_cores_contended()
    assert [r.message for r in caplog.records] == ["CPU cores are oversubscribed: x"]


def _is_frozen(obj: object) -> bool:
    # gc.get_objects() lists the collected generations, never the frozen one
    return not any(tracked is obj for tracked in gc.get_objects())


def test_frozen_gc_nests_and_leaves_what_the_host_froze_frozen():
    # Counts would be flaky (a frozen object that dies leaves the count), so watch one object.
    hosts_object = [object()]
    gc.freeze()  # the host's own freeze
    try:
        with frozen_gc():
            with frozen_gc():
                pass
            assert _is_frozen(hosts_object)  # the inner exit thawed nothing
        assert _is_frozen(hosts_object)
    finally:
        gc.unfreeze()
    ours = [object()]
    with frozen_gc():
        assert _is_frozen(ours)
    assert not _is_frozen(ours)

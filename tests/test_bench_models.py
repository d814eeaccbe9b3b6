"""The model benches' measurements (bench/model_suite.py) on the CPU, through the engine on
tiny random models: every code path runs and yields rows with the expected fields (their
times mean nothing here), at tensor parallel size 2 too (gloo)."""

import importlib
import json
import statistics

import pytest
import torch

from bcg.layers.embedding import Embedding, LMHead
from tests.hf_tiny import save_tiny_model

model_suite = importlib.import_module("bench.model_suite")
bench_moe = importlib.import_module("bench.bench_moe")
bench_decode = importlib.import_module("bench.bench_decode")
common = importlib.import_module("common")  # the name the benches import it by

# A vocabulary above bench_decode's prompt tokens (up to 5100), contexts of bench_offline's.
OVERRIDES = dict(vocab_size=8192, max_position_embeddings=4096)
ENGINE = dict(device="cpu", kv_cache_tokens=16384)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and where other processes share the
    cores, two threads contend with them: steps then run 10-50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine_args(tmp_path_factory, arch: str) -> dict:
    folder = tmp_path_factory.mktemp(arch)
    save_tiny_model(arch, folder, **OVERRIDES)
    return {"model": str(folder), **ENGINE}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return engine_args(tmp_path_factory, "qwen3")


@pytest.mark.parametrize("arch", ["qwen3", "nemotron_h"])
def test_prefill_rows_time_one_step_per_row_and_mode(tmp_path_factory, arch):
    """A row per (mode, batch, tokens), each step a prefill of fresh prompts (the function
    raises otherwise); on the CPU every mode runs eagerly. The hybrid's prompts each take a
    state slot."""
    shapes, trials = [(1, 16), (2, 32)], 2
    rows = model_suite.prefill_rows(engine_args(tmp_path_factory, arch), shapes,
                                    modes=("eager", "breakable"), trials=trials)
    assert [(r["mode"], r["batch"], r["tokens"]) for r in rows] == [
        (mode, b, t) for mode in ("eager", "breakable") for b, t in shapes]
    for row in rows:
        assert row["part"] == "prefill" and row["ms"] > 0 and row["startup_s"] > 0
        steps = trials * model_suite.prefill_iters(row["tokens"])
        assert row["forwards"] == {"eager": steps}
        assert row["capture_s"] is None and row["pool_gib"] is None


def test_a_setup_measures_decode_and_offline_with_its_facts(qwen3):
    """Decode at bench_decode's batch sizes with the weight-read floor; bench_offline's first
    request alone, marked scaled; each row names its configuration."""
    setup = model_suite.Setup(qwen3, parts=("decode", "offline"))
    rows = model_suite.measure_setup("tp1", setup, model_suite.PARTS, hbm_gbs=100.0,
                                     offline_requests=1)
    decode, offline = rows[:-1], rows[-1]
    assert [r["batch_size"] for r in decode] == list(model_suite.DECODE_BATCH_SIZES)
    for row in rows:
        assert (row["config"], row["tp"], row["device"]) == ("tp1", 1, "cpu")
        assert row["model"] == qwen3["model"] and row["expert_parallel"] is False
    for row in decode:
        assert row["part"] == "decode" and row["ms_per_step"] > 0
        assert len(row["round_ms"]) == bench_decode.DECODE_ROUNDS
        assert row["ms_per_step"] == statistics.median(row["round_ms"])
        assert row["floor_ms"] == pytest.approx(row["floor_bytes"] / 100e9 * 1e3)
        assert row["x_floor"] == pytest.approx(row["ms_per_step"] / row["floor_ms"])
    assert offline["part"] == "offline" and offline["requests"] == 1 and offline["scaled"]
    assert offline["output_tok_s"] > 0 and offline["overlap"] is False
    assert not any(row["custom_all_reduce"] for row in rows)  # one rank: no custom kernel


def test_parts_that_asked_for_a_kernel_of_ours_and_ran_without_it_are_named(capsys):
    rows = [{"config": "tp2-symm-mem", "part": part, "torch_symm_mem": True,
             "custom_all_reduce": active} for part, active in (("decode", True),
                                                               ("offline", False))]
    rows.append({"config": "tp2-nccl", "part": "offline", "tp": 2, "device": "NVIDIA H200",
                 "torch_symm_mem": False, "disable_custom_all_reduce": True,
                 "custom_all_reduce": None})
    rows += [{"config": "tp2", "part": part, "tp": 2, "device": "NVIDIA H200",
              "disable_custom_all_reduce": False, "custom_all_reduce": active}
             for part, active in (("decode", "custom"), ("offline", None))]
    rows += [{"config": "tp2-cpu", "part": "decode", "tp": 2, "device": "cpu",
              "disable_custom_all_reduce": False, "custom_all_reduce": None}]
    rows += [{"config": "tp2", "part": part, "tp": 2, "device": "NVIDIA H200",
              "disable_custom_all_reduce": False} for part in ("prefill", "graphs")]  # no say
    rows += [{"config": "tp2-custom", "part": "offline", "enable_custom_all_reduce": True,
              "custom_all_reduce": None}]  # a row from before it was the default
    model_suite.print_flag_fallbacks(rows)
    assert capsys.readouterr().out.splitlines() == [
        "note: tp2's offline rows ran on NCCL: the custom all-reduce (the default) did not "
        "take effect (the log says why)",
        "note: tp2-custom's offline rows ran on NCCL: --enable-custom-all-reduce did not take "
        "effect (the log says why)",
        "note: tp2-symm-mem's offline rows ran on NCCL: --enable-torch-symm-mem did not take "
        "effect (the log says why)"]


def test_tp2_engines_are_measured_one_after_another(qwen3):
    """Rank 0 times steps its worker follows; each engine's workers end before the next
    engine's start (one process group at a time)."""
    args = {**qwen3, "tensor_parallel_size": 2}
    prefill = model_suite.prefill_rows(args, [(2, 16)], modes=("eager",), trials=1)
    decode = model_suite.decode_rows(args, [1])
    assert prefill[0]["forwards"] == {"eager": model_suite.prefill_iters(16)}
    assert decode[0]["ms_per_step"] > 0
    assert decode[0]["floor_bytes"] < model_suite.decode_rows(qwen3, [1])[0]["floor_bytes"]


def test_graphs_part_starts_the_model_at_its_depth_and_a_quarter_of_it(qwen3):
    """On the CPU no graphs are captured: the rows carry the depth and start-up alone."""
    args = {**qwen3, "hf_overrides": {"num_hidden_layers": 4}}
    rows = model_suite.measure_setup("tp1", model_suite.Setup(args, model_suite.ALL_PARTS),
                                     [model_suite.GRAPHS_PART], hbm_gbs=None)
    assert [(r["part"], r["layers"]) for r in rows] == [("graphs", 4), ("graphs", 1)]
    assert all(r["startup_s"] > 0 and not any(k.endswith("_pool_gib") for k in r)
               for r in rows)


def test_moe_floor_reads_top_k_of_the_experts(tmp_path_factory):
    """The tiny MoE has 2 sparse layers of 4 experts (gate/up 2x32x64, down 64x32, fp32),
    top-2: a token reads half of each layer's experts."""
    rows = model_suite.decode_rows(engine_args(tmp_path_factory, "qwen3_moe"), [1],
                                   floors={"floor": common.decode_weight_bytes,
                                           "moe_floor": bench_moe.active_weight_bytes})
    unread_per_layer = 4 * (2 * 32 * 64 + 64 * 32) * 4 // 2
    assert rows[0]["floor_bytes"] - rows[0]["moe_floor_bytes"] == 2 * unread_per_layer
    assert "moe_floor_ms" not in rows[0]  # no bandwidth given


@pytest.mark.parametrize("tied", [False, True])
def test_decode_weight_bytes_skips_only_an_untied_embedding(tied):
    """Found by type, whatever the model names it (NemotronH: `embeddings`)."""
    model = torch.nn.Module()
    model.embeddings, model.proj = Embedding(10, 4), torch.nn.Linear(4, 4)
    model.lm_head = LMHead(10, 4)
    if tied:
        model.lm_head.tie_to(model.embeddings)
    assert common.decode_weight_bytes(model) == (4 * 4 + 4 + 10 * 4) * 4


def test_rows_of_a_run_replace_only_their_configs_parts(tmp_path, monkeypatch):
    common = importlib.import_module("common")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    earlier = [{"config": c, "part": p, "run": 1} for c in ("tp1", "tp2")
               for p in ("decode", "offline")]
    (tmp_path / "bench_x.json").write_text(json.dumps({"device": common.device_name(),
                                                       "rows": earlier}))
    fresh = [{"config": "tp2", "part": "decode", "run": 2}]
    merged = common.merged_rows("bench_x", fresh, model_suite.row_key)
    assert [(r["config"], r["part"], r["run"]) for r in merged] == [
        ("tp1", "decode", 1), ("tp1", "offline", 1), ("tp2", "offline", 1), ("tp2", "decode", 2)]


def test_rows_measured_on_another_device_are_left_out(tmp_path, monkeypatch, capsys):
    """A file names one device at its top: rows of another GPU kind do not stay beside the
    fresh ones, whether the file or the row says where they ran."""
    common = importlib.import_module("common")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    here = common.device_name()
    earlier = [{"config": "tp1", "part": "decode"},  # the file's device: another
               {"config": "tp1", "part": "offline", "device": here},
               {"config": "tp2", "part": "decode", "device": "NVIDIA H200"}]
    (tmp_path / "bench_x.json").write_text(json.dumps({"device": "NVIDIA H200",
                                                       "rows": earlier}))
    fresh = [{"config": "tp2", "part": "offline", "device": here}]
    merged = common.merged_rows("bench_x", fresh, model_suite.row_key)
    assert [(r["config"], r["part"]) for r in merged] == [("tp1", "offline"), ("tp2", "offline")]
    assert "2 earlier rows measured on another device" in capsys.readouterr().out


def test_defaults_follow_the_visible_gpus_and_larger_configs_are_refused(monkeypatch):
    defaults = {1: ["tp1"], 2: ["tp2", "ep2-allreduce"]}
    assert model_suite.default_configs("b", defaults, 1) == ["tp1"]
    assert model_suite.default_configs("b", defaults, 8) == ["tp2", "ep2-allreduce"]
    with pytest.raises(SystemExit, match="needs 2 GPUs, 1 visible"):
        model_suite.default_configs("b", {2: ["tp2"]}, 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    setups = {"tp1": bench_moe.SETUPS["tp1"], "ep2-alltoall": bench_moe.SETUPS["ep2-alltoall"]}
    with pytest.raises(SystemExit, match=r"ep2-alltoall \(2\) need more GPUs than the 1"):
        model_suite.require_gpus("bench_moe", setups)


def fake_rows(configs) -> list[dict]:
    """Rows shaped as bench_main's, of one run: prefill 2x slower in eager, piecewise 10%
    slower; tp2 steps at 0.6x tp1's, its output rate 1.6x."""
    return [{**row, "run": "2026-11-27 03:00:00"} for row in unstamped_fake_rows(configs)]


def unstamped_fake_rows(configs) -> list[dict]:
    rows = []
    for config in configs:
        scale = 0.6 if config.startswith(("tp2", "ep2")) else 1.0
        rows += [{"config": config, "part": "prefill", "mode": mode, "batch": 1, "tokens": 16,
                  "ms": ms} for mode, ms in (("eager", 2.0), ("breakable", 1.0),
                                             ("piecewise", 1.1))]
        rows += [{"config": config, "part": "decode", "batch_size": 1, "ms_per_step": 10 * scale,
                  "tokens_per_s": 100 / scale, "floor_ms": 8.0, "x_floor": 1.25 * scale,
                  "moe_floor_ms": 7.5 * scale, "x_moe_floor": 1.33}]
        rows.append({"config": config, "part": "offline", "requests": 256, "scaled": False,
                     "output_tok_s": 1000 / scale, "tokens_per_s": 2000 / scale,
                     "seconds": 1.0, "startup_s": 1.0})
        rows += [{"config": config, "part": "graphs", "layers": layers, "startup_s": startup,
                  "prefill_pool_gib": 0.5, "decode_pool_gib": pool}
                 for layers, startup, pool in ((64, 8.0, 0.6), (16, 5.0, 0.5))]
    return rows


@pytest.mark.parametrize("bench,expected", [
    ("bench_tp", ["tp2 / tp1 decode step at batch 1: 0.600", "tp2 / tp1 output tok/s: 1.667"]),
    ("bench_moe", ["ep2-alltoall: moe_floor_ms / decode step at batch 1: 0.750"]),
    ("bench_hybrid", ["tp1: least eager / breakable at ≤ 256 tokens: 2.000",
                      "tp2: decode step at batch 1 / weight-read floor: 0.750"]),
    ("bench_multi_gpu", ["qwen3-32b-tp4: graph pools at full depth / at a quarter: 1.100",
                         "qwen3-235b-ep8-alltoall: start-up s, every graph captured: 8.000"]),
])
def test_reports_print_the_targets(capsys, bench, expected):
    module = importlib.import_module(f"bench.{bench}")
    module.report(fake_rows(module.SETUPS))
    out = capsys.readouterr().out
    assert "breakable ≤ piecewise: every row" in out
    for line in expected:
        assert line in out


def test_the_decode_table_shows_how_far_apart_a_rows_rounds_are(capsys):
    """A round slowed by a stall shows as its slowest / fastest; rows from before rounds
    were kept show a dash."""
    rows = unstamped_fake_rows(["tp1", "tp2"])
    rows[[r["part"] for r in rows].index("decode")]["round_ms"] = [10.0, 10.2, 15.0]
    model_suite.print_decode_table(rows)
    header, _, tp1, tp2 = capsys.readouterr().out.strip().splitlines()[1:]
    assert header.endswith("rounds max/min")
    assert tp1.split()[-1] == "1.500" and tp2.split()[-1] == "-"


def test_a_ratio_of_rows_of_different_runs_says_so(capsys):
    """A row kept from an earlier run (another call, maybe another machine of the kind) is
    no fair denominator for today's: the target line names both runs."""
    module = importlib.import_module("bench.bench_tp")
    rows = fake_rows(["tp1", "tp2-nccl"])
    rows += [{**row, "run": "2026-11-25 10:00:00"} for row in unstamped_fake_rows(["tp2"])]
    rows += unstamped_fake_rows(["tp2-symm-mem"])
    module.report(rows)
    out = capsys.readouterr().out
    assert "tp2-nccl / tp1 decode step at batch 1: 0.600 (target ≤ 0.62)\n" in out
    assert ("tp2 / tp1 decode step at batch 1: 0.600 (target ≤ 0.62; rows of different runs "
            "(2026-11-25 10:00:00 and 2026-11-27 03:00:00): compare within one run)") in out
    assert ("tp2-symm-mem / tp1 output tok/s: 1.667 (target ≥ 1.5; rows not stamped with "
            "their run: compare within one run)") in out

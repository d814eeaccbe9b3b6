"""Measurements shared by the model benches (`bench_tp`, `bench_moe`, `bench_hybrid`), each
through the engine's public API at any tensor-parallel size. Under tensor parallelism rank 0
spawns the other ranks, which follow its steps, so every timed step is an
`LLMEngine.step()`: a forward of rank 0 alone would wait for collectives no rank joins.

- prefill: bench_prefill's rows (`batch` fresh prompts sharing `tokens` new tokens, no
  prefix-cache hit), each the wall time of the one engine step that prefills them all and
  samples their first token (scheduling, batch building, the stack, the head and sampling),
  per graph mode: one engine per mode (`prefill_graph=...`, token buckets equal to the
  measured token counts, no decode graphs, steps not overlapped so that a step's time is all
  of it). Engines cannot run side by side under tensor parallelism (one process group), so
  the interleaving is over the rows of one engine: `trials` rounds, each timing every row in
  turn (the mean of a few steps), after one untimed round (Triton and Inductor compile on
  first use); a row is the median round.
- decode: bench_decode's `round_seconds` (every request decoding, ms per engine step in each
  of a few rounds; the row is the median round and keeps all of them in `round_ms`, so a
  slow round shows) at batch sizes 1, 8, 64, with weight-read floors: bytes one forward
  reads on a rank / HBM bandwidth.
- offline: bench_offline's workload through `LLM.generate` (its `run_bcg`, default graphs),
  output tok/s; `--offline-requests N` runs only its first N requests (the row is `scaled`).
- graphs (only for setups that list it): an engine with the default graphs at the model's
  layer count and at a quarter of it: seconds until `LLM(...)` is ready (every graph
  captured) and each graph runner's pool on rank 0; a pool that does not grow with depth
  stays flat.

Engines run one at a time, each closed and its memory handed back before the next starts
(bench_offline's `on_engine`). A bench names its configurations (`Setup`) and calls
`bench_main`; rows of an earlier run of other configurations or parts are kept. Each row
carries its `run` (when its bench command started): a ratio of two configurations' rows of
different runs says so, since machines differ by a few percent from call to call.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_decode import round_seconds  # noqa: E402
from bench_offline import (  # noqa: E402
    NUM_REQUESTS,
    custom_all_reduce_active,
    on_engine,
    release_cuda_memory,
    run_bcg,
    same_lengths,
    throughput_row,
    workload,
)

from bcg.config import EngineConfig  # noqa: E402
from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.llm_engine import LLMEngine  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402
from bcg.loader.model_source import resolve_model  # noqa: E402

PARTS = ("prefill", "decode", "offline")
GRAPHS_PART = "graphs"  # measured only on setups that list it
ALL_PARTS = (*PARTS, GRAPHS_PART)
LAYER_DIVISORS = (1, 4)  # the graphs part's depths: all the model's layers, and a quarter
PREFILL_MODES = {"eager": "none", "breakable": "breakable", "piecewise": "piecewise"}  # -> flag
PREFILL_SHAPES = tuple((batch, tokens) for batch in (1, 4, 16)
                       for tokens in (16, 64, 256, 1024, 4096))
DECODE_BATCH_SIZES = (1, 8, 64)
OFFLINE_MODE = "decode + breakable"  # the engine's default graphs
# Floor name -> the bytes of weights a forward reads on a rank.
WEIGHT_FLOOR = {"floor": common.decode_weight_bytes}
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

Floors = Mapping[str, Callable[[torch.nn.Module], int]]


@dataclass(frozen=True)
class Setup:
    """A configuration of a model: its engine arguments (`LLM`'s, the model included) and
    the parts measured on it."""

    engine_args: dict
    parts: tuple[str, ...] = PARTS

    @property
    def gpus(self) -> int:
        return self.engine_args.get("tensor_parallel_size", 1)


TP2_CONFIGS = ("tp2", "tp2-nccl", "tp2-symm-mem")  # tp2 and its all-reduce variants


def tensor_parallel_setups(model: str) -> dict[str, Setup]:
    """`model` at two ranks (`tp2`: decode-sized all-reduces through the custom all-reduce,
    the default) and, decode and offline, with every all-reduce through NCCL (`tp2-nccl`)
    and with the small ones through torch symmetric memory (`tp2-symm-mem`)."""
    two_ranks = {"model": model, "tensor_parallel_size": 2}
    variants = ("decode", "offline")
    return {"tp2": Setup(two_ranks),
            "tp2-nccl": Setup({**two_ranks, "disable_custom_all_reduce": True}, variants),
            "tp2-symm-mem": Setup({**two_ranks, "enable_torch_symm_mem": True}, variants)}


def prefill_rows(engine_args: dict, shapes: Iterable[tuple[int, int]] = PREFILL_SHAPES,
                 modes: Iterable[str] = PREFILL_MODES, trials: int = 5) -> list[dict]:
    """A row per (mode, batch, tokens): ms of the engine step that prefills `batch` fresh
    prompts of `tokens // batch` tokens each, with the mode engine's start-up facts."""
    shapes = list(shapes)
    rows = []
    for mode in modes:
        timings, startup = on_engine(
            functools.partial(time_prefills, shapes=shapes, trials=trials),
            **prefill_engine_args(engine_args, mode, shapes))
        rows += [{"part": "prefill", "mode": mode, **row, "startup_s": startup}
                 for row in timings]
    return rows


def prefill_engine_args(engine_args: dict, mode: str, shapes: list[tuple[int, int]]) -> dict:
    """An engine that prefills each shape in one step through `mode`'s graphs (a bucket per
    token count, so no row pays for padding)."""
    tokens = sorted({t for _, t in shapes})
    return {"max_model_len": max(t // b for b, t in shapes) + 1,
            "max_num_seqs": max(b for b, _ in shapes),
            "max_num_batched_tokens": tokens[-1],
            "prefill_graph_tokens": ",".join(map(str, tokens)),
            **engine_args,
            # Decode graphs would take batches of one-token prompts: prefills stay prefills.
            "prefill_graph": PREFILL_MODES[mode], "decode_graph": "none", "overlap": False}


def time_prefills(llm: LLM, shapes: list[tuple[int, int]], trials: int) -> list[dict]:
    engine, seeds = llm.engine, itertools.count()
    paths = {shape: Counter() for shape in shapes}  # which forward served the timed steps
    for batch, tokens in shapes:
        prefill_step_ms(engine, batch, tokens, next(seeds), Counter())
    rounds = {shape: [] for shape in shapes}
    for _ in range(trials):
        for batch, tokens in shapes:
            steps = [prefill_step_ms(engine, batch, tokens, next(seeds), paths[batch, tokens])
                     for _ in range(prefill_iters(tokens))]
            rounds[batch, tokens].append(statistics.fmean(steps))
    graphs = next((r for r in engine.runner.graph_runners if r.kind == "prefill"), None)
    return [{"batch": batch, "tokens": tokens // batch * batch,
             "ms": statistics.median(rounds[batch, tokens]),
             "forwards": dict(paths[batch, tokens]),
             "capture_s": graphs.capture_seconds if graphs else None,
             "pool_gib": graphs.pool_bytes / 2**30 if graphs else None}
            for batch, tokens in shapes]


def prefill_iters(tokens: int) -> int:
    """Steps per row and round: more where a step is short and noisy."""
    return max(1, min(10, 1024 // tokens))


def prefill_step_ms(engine: LLMEngine, batch: int, tokens: int, seed: int,
                    paths: Counter) -> float:
    """Wall time of the step that prefills `batch` new prompts (random tokens from `seed`, so
    no prefix-cache hit) and samples their one token; `paths` counts the forwards it ran."""
    assert not engine.overlap, "an overlapped step returns before its work is done"
    vocab = engine.model_config.vocab_size
    length = tokens // batch
    prompts = [p for p, _ in same_lengths([([0] * length, 1)] * batch, vocab, seed)]
    engine.add_requests(prompts, [FIRST_TOKEN] * batch)
    before = Counter(engine.runner.forward_counts)
    common.synchronize()
    start = time.perf_counter()
    outputs = engine.step()
    common.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    paths.update(engine.runner.forward_counts - before)
    if (len(outputs) != batch or engine.has_unfinished_requests()
            or any(o.num_cached_tokens for o in outputs)):
        raise RuntimeError(f"the prefill of {batch} x {length} tokens was not one step of "
                           f"fresh prompts ({len(outputs)} outputs, cached tokens "
                           f"{[o.num_cached_tokens for o in outputs]}): its time is no row")
    return ms


def decode_rows(engine_args: dict, batch_sizes: Iterable[int] = DECODE_BATCH_SIZES,
                hbm_gbs: float | None = None, floors: Floors = WEIGHT_FLOOR) -> list[dict]:
    """A row per batch size: ms per engine step with every request decoding (the median of
    bench_decode's `round_seconds`, each round kept in `round_ms`), and per floor
    `{name}_bytes` (rank 0's weights a forward reads); with `hbm_gbs`, `{name}_ms` (those
    bytes at that bandwidth) and `x_{name}` (ms / floor)."""
    batch_sizes = list(batch_sizes)
    args = {"max_model_len": 1024, "max_num_seqs": max(batch_sizes),
            "decode_graph_bs": ",".join(map(str, batch_sizes)), "prefill_graph": "none",
            **engine_args}
    rows, _ = on_engine(functools.partial(time_decodes, batch_sizes=batch_sizes,
                                          hbm_gbs=hbm_gbs, floors=floors), **args)
    return rows


def time_decodes(llm: LLM, batch_sizes: list[int], hbm_gbs: float | None,
                 floors: Floors) -> list[dict]:
    floor_bytes = {name: count(llm.engine.runner.model) for name, count in floors.items()}
    custom_all_reduce = custom_all_reduce_active()
    rows = []
    for batch in batch_sizes:
        round_ms = [seconds * 1e3 for seconds in round_seconds(llm.engine, batch)]
        ms = statistics.median(round_ms)
        row = {"part": "decode", "batch_size": batch, "ms_per_step": ms, "round_ms": round_ms,
               "tokens_per_s": batch / ms * 1e3, "custom_all_reduce": custom_all_reduce}
        for name, num_bytes in floor_bytes.items():
            row[f"{name}_bytes"] = num_bytes
            if hbm_gbs:
                row[f"{name}_ms"] = num_bytes / (hbm_gbs * 1e9) * 1e3
                row[f"x_{name}"] = ms / row[f"{name}_ms"]
        rows.append(row)
    return rows


def offline_row(engine_args: dict, num_requests: int = NUM_REQUESTS, repeats: int = 1) -> dict:
    """bench_offline's row for the first `num_requests` requests of its workload, on an
    engine with the default graphs (`engine_args` may change them)."""
    model = engine_args["model"]
    vocab = resolve_model(model, dummy_weights=True).config.vocab_size
    requests = workload(vocab)[:num_requests]
    overlap = EngineConfig(**engine_args).overlaps_steps
    run = run_bcg(model, OFFLINE_MODE, requests, repeats,
                  **{k: v for k, v in engine_args.items() if k != "model"})
    return {"part": "offline", **throughput_row(model, OFFLINE_MODE, requests, run, overlap),
            "scaled": num_requests < NUM_REQUESTS}


def graphs_rows(engine_args: dict) -> list[dict]:
    """A row per depth of `LAYER_DIVISORS` (the model's `num_hidden_layers` divided): the
    seconds `LLM(...)` took with the default graphs, and each graph runner's pool and
    capture seconds (rank 0's)."""
    overrides = engine_args.get("hf_overrides") or {}
    config = resolve_model(engine_args["model"], dummy_weights=True,
                           hf_overrides=overrides).config
    rows = []
    for divisor in LAYER_DIVISORS:
        layers = max(1, config.num_hidden_layers // divisor)
        args = {**engine_args, "hf_overrides": {**overrides, "num_hidden_layers": layers}}
        graphs, startup = on_engine(graph_facts, **args)
        rows.append({"part": GRAPHS_PART, "layers": layers, "startup_s": startup, **graphs})
    return rows


def graph_facts(llm: LLM) -> dict:
    """`{kind}_pool_gib` and `{kind}_capture_s` of each of the engine's graph runners."""
    facts = {}
    for runner in llm.engine.runner.graph_runners:
        facts[f"{runner.kind}_pool_gib"] = runner.pool_bytes / 2**30
        facts[f"{runner.kind}_capture_s"] = runner.capture_seconds
    return facts


def measure_setup(name: str, setup: Setup, parts: Iterable[str], hbm_gbs: float | None,
                  offline_requests: int = NUM_REQUESTS, repeats: int = 1,
                  floors: Floors = WEIGHT_FLOOR) -> list[dict]:
    """The rows of `parts` (those the setup has) on dummy weights, each carrying the
    configuration's facts."""
    args = {"load_format": "dummy", **setup.engine_args}
    parts = [part for part in parts if part in setup.parts]
    rows = []
    if "prefill" in parts:
        rows += prefill_rows(args)
    if "decode" in parts:
        rows += decode_rows(args, hbm_gbs=hbm_gbs, floors=floors)
    if "offline" in parts:
        rows.append(offline_row(args, offline_requests, repeats))
    if GRAPHS_PART in parts:
        rows += graphs_rows(args)
    config = EngineConfig(**args)
    facts = {"config": name, "model": config.model, "tp": config.tensor_parallel_size,
             "expert_parallel": config.enable_expert_parallel,
             "ep_dispatch": config.ep_dispatch if config.enable_expert_parallel else None,
             "ep_fixed_block_tokens": (config.alltoall_fixed_block_tokens
                                       if config.uses_alltoall else None),
             "torch_symm_mem": config.enable_torch_symm_mem,
             "disable_custom_all_reduce": config.disable_custom_all_reduce,
             "decode_graph": config.decode_graph, "device": device_name(config),
             "gpus": torch.cuda.device_count(), "torch": torch.__version__}
    return [{**facts, **row} for row in rows]


def device_name(config: EngineConfig) -> str:
    device = config.torch_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def row_key(row: dict) -> tuple:
    """A run of some configurations or parts replaces only those of the earlier results."""
    return row["config"], row["part"]


def bench_main(name: str, doc: str, setups: Mapping[str, Setup],
               defaults: Mapping[int, list[str]], report: Callable[[list[dict]], None],
               repeats: int = 1, floors: Floors = WEIGHT_FLOOR) -> None:
    """A model bench's command line: measure the chosen configurations (`defaults`: the
    configurations run by default when at least that many GPUs are visible, the largest such
    count chosen), writing `bench/results/{name}.json` after each part, then `report` this
    device's rows (earlier runs' included). A part that raises is reported and skipped."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(setups),
                        help="default: " + "; ".join(f"{' '.join(c)} with {n}+ GPUs"
                                                     for n, c in sorted(defaults.items())))
    parser.add_argument("--parts", nargs="+", choices=ALL_PARTS, default=list(ALL_PARTS),
                        help="what to measure (default: all; graphs only where a "
                        "configuration has it)")
    parser.add_argument("--offline-requests", type=int, default=NUM_REQUESTS,
                        help="run only the first N requests of the offline workload "
                        f"(default: all {NUM_REQUESTS}; the row is marked scaled)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed offline runs per engine, the median kept (default {repeats})")
    args = parser.parse_args()
    if not 1 <= args.offline_requests <= NUM_REQUESTS:
        parser.error(f"--offline-requests must be in [1, {NUM_REQUESTS}]")
    common.require_cuda(name)
    configs = args.configs or default_configs(name, defaults, torch.cuda.device_count())
    require_gpus(name, {config: setups[config] for config in configs})
    hbm_gbs = common.hbm_bandwidth_gbs()
    release_cuda_memory()
    rows, failed = [], []
    run = time.strftime("%Y-%m-%d %H:%M:%S")
    for config, part in itertools.product(configs, args.parts):
        try:
            rows += [{**row, "run": run} for row in measure_setup(
                config, setups[config], [part], hbm_gbs, args.offline_requests, args.repeats,
                floors)]
        except Exception:  # the other parts still run; the exit status says this one failed
            traceback.print_exc()
            failed.append(f"{config} {part}")
            release_cuda_memory()
            continue
        # Written after each part: a run cut off keeps the finished ones.
        common.write_results(name, {"hbm_gbs": hbm_gbs,
                                    "rows": common.merged_rows(name, rows, row_key)})
    device = torch.cuda.get_device_name()
    report([row for row in common.merged_rows(name, rows, row_key) if row["device"] == device])
    if failed:
        raise SystemExit(f"{name}: failed: {', '.join(failed)} (tracebacks above)")


def default_configs(name: str, defaults: Mapping[int, list[str]], visible: int) -> list[str]:
    fitting = [count for count in defaults if count <= visible]
    if not fitting:
        raise SystemExit(f"{name}: needs {min(defaults)} GPUs, {visible} visible")
    return defaults[max(fitting)]


def require_gpus(name: str, setups: Mapping[str, Setup]) -> None:
    """Refuse, before any engine starts, configurations that need more GPUs than visible."""
    visible = torch.cuda.device_count()
    too_large = [f"{config} ({setup.gpus})" for config, setup in setups.items()
                 if setup.gpus > visible]
    if too_large:
        raise SystemExit(f"{name}: {', '.join(too_large)} need more GPUs than the {visible} "
                         "visible: run them on a machine with as many (or check "
                         "CUDA_VISIBLE_DEVICES), or choose others with --configs")


def rows_of(rows: list[dict], part: str) -> list[dict]:
    return [row for row in rows if row["part"] == part]


def find_row(rows: list[dict], config: str, part: str, **match) -> dict | None:
    """`config`'s row of `part` matching `match`, or None if it was not measured."""
    for row in rows:
        if (row["config"], row["part"]) == (config, part) and all(
                row.get(k) == v for k, v in match.items()):
            return row
    return None


def value(rows: list[dict], config: str, part: str, field: str, **match) -> float | None:
    """`field` of `config`'s row of `part` matching `match`, or None if it was not measured."""
    row = find_row(rows, config, part, **match)
    return None if row is None else row.get(field)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def print_config_ratio(label: str, rows: list[dict], numerator: str, denominator: str,
                       part: str, field: str, target: str, **match) -> None:
    """`field` of configuration `numerator` over that of `denominator` (e.g. tp2 / tp1)
    against `target`, saying so when the two rows are not of one run."""
    top, bottom = (find_row(rows, config, part, **match) for config in (numerator, denominator))
    if top is None or bottom is None:
        print_target(label, None, target)
        return
    runs = {top.get("run"), bottom.get("run")}
    if None in runs:
        target += "; rows not stamped with their run: compare within one run"
    elif len(runs) > 1:
        target += f"; rows of different runs ({' and '.join(sorted(runs))}): compare within one run"
    print_target(label, ratio(top.get(field), bottom.get(field)), target)


def print_tables(rows: list[dict], floor: str = "floor") -> None:
    print_prefill_table(rows)
    print_decode_table(rows, floor)
    print_offline_table(rows)
    if rows_of(rows, GRAPHS_PART):
        print_graphs_table(rows)
    print_flag_fallbacks(rows)


def print_flag_fallbacks(rows: list[dict]) -> None:
    """Name each configuration's part that asked for an all-reduce kernel of ours and ran
    without it (each falls back, logged, where it cannot run; torch symmetric memory's
    before the custom all-reduce; rows from before the custom all-reduce say True or False)."""
    fell_back = set()
    for r in rows:
        asked = kernel_asked(r)
        if asked is None or "custom_all_reduce" not in r:  # only decode and offline rows say
            continue
        flag, wanted = asked
        ran = r.get("custom_all_reduce")
        if ran not in (True, wanted):
            fell_back.add((r["config"], r["part"], flag, ran or "NCCL"))
    for config, part, flag, ran in sorted(fell_back):
        print(f"note: {config}'s {part} rows ran on {ran}: {flag} did not take effect (the log "
              "says why)")


def kernel_asked(row: dict) -> tuple[str, str] | None:
    """(what asked for it, its name in the rows) of the all-reduce kernel of ours a row's
    configuration asked for, or None: torch symmetric memory's flag, else the custom
    all-reduce at several GPUs unless turned off (rows from before it was the default carry
    `enable_custom_all_reduce` instead)."""
    if row.get("torch_symm_mem"):
        return "--enable-torch-symm-mem", "symm-mem"
    if "disable_custom_all_reduce" in row:
        default_on = (row.get("tp", 1) > 1 and row.get("device") != "cpu"
                      and not row["disable_custom_all_reduce"])
        return ("the custom all-reduce (the default)", "custom") if default_on else None
    return ("--enable-custom-all-reduce", "custom") if row.get("enable_custom_all_reduce") \
        else None


def print_prefill_table(rows: list[dict]) -> None:
    """Every prefill row, the modes side by side, with eager / breakable and breakable /
    piecewise (the targets: breakable ≤ piecewise everywhere)."""
    prefill = rows_of(rows, "prefill")
    keys = list(dict.fromkeys((r["config"], r["batch"], r["tokens"]) for r in prefill))
    table = []
    for config, batch, tokens in keys:
        ms = {mode: value(prefill, config, "prefill", "ms", mode=mode, batch=batch,
                          tokens=tokens) for mode in PREFILL_MODES}
        table.append([config, batch, tokens, *[m if m is not None else "-" for m in ms.values()],
                      shown(ratio(ms["eager"], ms["breakable"])),
                      shown(ratio(ms["breakable"], ms["piecewise"]))])
    common.print_table("prefill engine step, ms (median of interleaved rounds)",
                ["config", "batch", "tokens", *PREFILL_MODES, "eager/breakable",
                 "breakable/piecewise"], table)
    slower = [f"{c} {b}x{t}" for c, b, t, *_, over_piecewise in table
              if over_piecewise != "-" and over_piecewise > 1]
    print(f"breakable ≤ piecewise: {'every row' if not slower else 'not on ' + ', '.join(slower)}")


def print_decode_table(rows: list[dict], floor: str = "floor") -> None:
    """Every decode row with the named floor (`{floor}_ms`, `x_{floor}`) and the slowest of
    its rounds over the fastest (a stall shows as one round far above 1)."""
    common.print_table(f"decode engine step, median round (x {floor} = ms / {floor}_ms)",
                ["config", "batch", "ms/step", "tok/s", f"{floor} ms", f"x {floor}",
                 "rounds max/min"],
                [[r["config"], r["batch_size"], r["ms_per_step"], r["tokens_per_s"],
                  shown(r.get(f"{floor}_ms")), shown(r.get(f"x_{floor}")),
                  shown(round_spread(r))]
                 for r in rows_of(rows, "decode")])


def round_spread(row: dict) -> float | None:
    """The slowest round over the fastest (None for rows from before rounds were kept)."""
    rounds = row.get("round_ms")
    return max(rounds) / min(rounds) if rounds else None


def print_offline_table(rows: list[dict]) -> None:
    common.print_table("offline throughput (bench_offline's workload, default graphs)",
                ["config", "requests", "out tok/s", "tok/s (in+out)", "run s", "start-up s"],
                [[r["config"], f"{r['requests']}{' (scaled)' if r['scaled'] else ''}",
                  r["output_tok_s"], r["tokens_per_s"], r["seconds"], r["startup_s"]]
                 for r in rows_of(rows, "offline")])


def print_graphs_table(rows: list[dict]) -> None:
    common.print_table("start-up and graph pools (default graphs, rank 0)",
                ["config", "layers", "start-up s", "prefill pool GiB", "decode pool GiB",
                 "prefill capture s", "decode capture s"],
                [[r["config"], r["layers"], r["startup_s"],
                  *[shown(r.get(f"{kind}_{fact}")) for fact in ("pool_gib", "capture_s")
                    for kind in ("prefill", "decode")]]
                 for r in rows_of(rows, GRAPHS_PART)])


def deepest_and_shallowest(rows: list[dict], config: str) -> tuple[dict, dict] | None:
    """`config`'s graphs rows at its largest and smallest depth, if it has any."""
    graphs = [r for r in rows_of(rows, GRAPHS_PART) if r["config"] == config]
    if not graphs:
        return None
    return max(graphs, key=lambda r: r["layers"]), min(graphs, key=lambda r: r["layers"])


def pool_growth(rows: list[dict], config: str) -> float | None:
    """Rank 0's graph pools (all runners) at the model's depth over those at a quarter of
    it: 1 where the pool does not grow with the layers."""
    depths = deepest_and_shallowest(rows, config)
    if depths is None or depths[0] is depths[1]:
        return None
    deep, shallow = (sum(v for k, v in r.items() if k.endswith("_pool_gib")) for r in depths)
    return ratio(deep, shallow)


def print_target(label: str, got: float | None, target: str) -> None:
    print(f"{label}: {'not measured' if got is None else f'{got:.3f}'} (target {target})")


def shown(number: float | None) -> float | str:
    return "-" if number is None else number

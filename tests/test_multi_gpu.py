"""Tensor and expert parallelism on several GPUs (NCCL, bf16; the GPU suite's tiny models and
the presets with dummy weights): the logits of a model split over N GPUs match those of one
GPU in the same graph mode within the GPU suite's bf16 tolerance, in every graph mode
(breakable prefill with full decode graphs, piecewise prefill with breakable decode graphs,
eager, debug mode) and for each parallel layout of the model (tensor parallel; MoE also
expert parallel with either dispatch; by default decode-sized all-reduces run through the
custom all-reduce, and the tiny models also run with `--disable-custom-all-reduce` (NCCL
for all) and with `--enable-torch-symm-mem`).
Where one GPU cannot hold the model, the reference is two GPUs (qwen3-32b: 65 GB of bf16
weights), or a few of its layers (`hf_overrides`) keep its shapes. A case skips unless as
many GPUs as its ranks are visible.

The logits are those of `split_runs.step_logits`: a prefill of three prompts, a decode step
of all three and one of the first alone, the decoded tokens fixed. One GPU in the same mode is
the reference, not eager: piecewise graphs run Inductor's kernels, whose bf16 rounding alone
moves a 36-layer model of random weights 5% from eager (qwen3-8b on the H100).

That rounding also sets the tolerance of a deep model. Splitting a layer changes the order of
its sums, as Inductor's fusions do; over dozens of random layers either moves the logits
beyond the 3e-2 that suits the suite's tiny models (qwen3-8b tp2 on two H200s: 4.7e-2 to
5.3e-2 in every mode). So a split run may be as far from one GPU as one GPU's piecewise run is
from its eager run, with half again as margin: a split that is wrong (a weight cut apart
differently, a collective missed) lands far beyond (5e-1 for a NemotronH whose dummy Mamba
weights were drawn per rank)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import queue
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bcg.distributed import launcher, parallel_state, rank_loop
from bcg.distributed.launcher import TensorParallelError
from bcg.distributed.parallel_state import tensor_parallel
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from tests.dying_worker import FAILURE_SECONDS, worker_dying_in_a_step
from tests.hf_tiny import save_tiny_model
from tests.numerics import relative_error
from tests.split_runs import PROMPTS, split_runs

pytestmark = pytest.mark.gpu

TOLERANCE = 3e-2  # the bf16 tolerance of the GPU suite (tests/hf_tiny.py RUNS)
ROUNDING_MARGIN = 1.5  # how much further than one GPU's own rounding spread a split may be
# Small buckets: the prompts (26 tokens) fill the 32-token prefill graph, the decode steps
# the 4- and 1-sequence decode graphs.
BUCKETS = {"prefill_graph_tokens": "16,32", "decode_graph_bs": "1,4", "max_model_len": 128}
GRAPH_MODES = {
    "breakable+full": {"prefill_graph": "breakable", "decode_graph": "full"},
    "piecewise+breakable": {"prefill_graph": "piecewise", "decode_graph": "breakable"},
    "eager": {"prefill_graph": "none", "decode_graph": "none"},
    "debug": {"debug_cuda_graph": True},
}
DENSE = {"tp": {}}
MOE = {"tp": {},
       "ep-allreduce": {"enable_expert_parallel": True, "ep_dispatch": "allreduce"},
       # fixed blocks up to 4 tokens: the prefill (26 tokens) exchanges counted rows through
       # graph breaks, the decode steps fixed-size blocks inside the decode graphs; by
       # default the prefill too (its 32-token bucket) inside breakable segments, unless
       # compiled
       "ep-alltoall": {"enable_expert_parallel": True, "ep_dispatch": "alltoall",
                       "max_num_seqs": 4, "ep_fixed_block_tokens": 4},
       "ep-alltoall fixed": {"enable_expert_parallel": True, "ep_dispatch": "alltoall"}}
# On the tiny models also every all-reduce through NCCL, and the small ones through torch
# symmetric memory.
NCCL = {"disable_custom_all_reduce": True}
SYMM_MEM = {"enable_torch_symm_mem": True}
DENSE_SYMM_MEM = {**DENSE, "tp nccl": NCCL, "tp symm-mem": SYMM_MEM}
MOE_SYMM_MEM = {**MOE, "tp nccl": NCCL, "tp symm-mem": SYMM_MEM,
                "ep-allreduce symm-mem": {**MOE["ep-allreduce"], **SYMM_MEM}}


@dataclass(frozen=True)
class Case:
    model: str  # a preset (dummy weights), or with `tiny` an architecture of tests/hf_tiny.py
    ranks: int
    layouts: dict[str, dict]  # name -> engine arguments
    hf_overrides: dict | None = None
    tiny: bool = False  # a tiny random model saved as a Hugging Face folder (its weights)
    reference_ranks: int = 1  # the GPUs of the reference run: 2 where one cannot hold it

    def runs(self) -> dict[str, dict]:
        """Each layout in each graph mode: name -> engine arguments."""
        return {f"{layout} {mode}": self.run_args(layout_args, mode_args)
                for layout, layout_args in self.layouts.items()
                for mode, mode_args in GRAPH_MODES.items()}

    def run_args(self, layout_args: dict, mode_args: dict) -> dict:
        return {**self.common_args(), **layout_args, **mode_args}

    @staticmethod
    def reference_args(run_args: dict) -> dict:
        """The same run on the reference GPUs: tensor parallel only, experts whole."""
        return {k: v for k, v in run_args.items()
                if k not in ("enable_expert_parallel", "ep_dispatch", "ep_fixed_block_tokens",
                             *SYMM_MEM, *NCCL)}

    def common_args(self) -> dict:
        return {"load_format": "auto" if self.tiny else "dummy", "dtype": "bfloat16",
                "hf_overrides": self.hf_overrides, **BUCKETS}

    def model_path(self, folder: Path) -> str:
        """The preset's name, or the tiny model saved in `folder`."""
        if not self.tiny:
            return self.model
        save_tiny_model(self.model, folder, max_position_embeddings=BUCKETS["max_model_len"])
        return str(folder)


CASES = {
    # the GPU suite's tiny models (tests/test_graph_runners_gpu.py), split
    "tiny-llama-tp2": Case("llama", 2, DENSE_SYMM_MEM, tiny=True),
    "tiny-qwen3-tp2": Case("qwen3", 2, DENSE_SYMM_MEM, tiny=True),
    "tiny-qwen3_moe-2gpus": Case("qwen3_moe", 2, MOE_SYMM_MEM, tiny=True),
    "tiny-nemotron_h-tp2": Case("nemotron_h", 2, DENSE_SYMM_MEM, tiny=True),
    "qwen3-8b-tp2": Case("qwen3-8b", 2, DENSE),
    "qwen3-30b-a3b-2gpus": Case("qwen3-30b-a3b", 2, MOE),
    "nemotron-h-8b-tp2": Case("nemotron-h-8b", 2, DENSE),
    "qwen3-32b-tp4": Case("qwen3-32b", 4, DENSE, reference_ranks=2),
    # 94 layers do not fit one GPU: 4 of them, each of the published shapes
    "qwen3-235b-a22b-8gpus": Case("qwen3-235b-a22b", 8, MOE, {"num_hidden_layers": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_model_gives_one_gpus_logits_in_every_graph_mode(case, tmp_path):
    spec = CASES[case]
    visible = torch.cuda.device_count()
    if visible < spec.ranks:
        pytest.skip(f"needs {spec.ranks} GPUs, {visible} visible")
    model = spec.model_path(tmp_path / "model")
    runs = spec.runs()
    references = []  # each distinct one-GPU run once
    for args in runs.values():
        if spec.reference_args(args) not in references:
            references.append(spec.reference_args(args))
    # Each in its own processes: the references' memory is back before the split model loads.
    (reference_results,) = split_runs(spec.reference_ranks, "cuda", [(model, references)],
                                      tmp_path / "reference.pt")
    (results,) = split_runs(spec.ranks, "cuda", [(model, list(runs.values()))],
                            tmp_path / "split.pt")

    def reference(args: dict) -> list[torch.Tensor]:
        return reference_results[references.index(spec.reference_args(args))][0]

    first_layout = next(iter(spec.layouts.values()))
    spread = largest_error(*(reference(spec.run_args(first_layout, GRAPH_MODES[mode]))
                             for mode in ("piecewise+breakable", "eager")))
    tolerance = max(TOLERANCE, ROUNDING_MARGIN * spread)
    errors = {name: largest_error(logits, reference(args))
              for (name, args), (logits, _) in zip(runs.items(), results, strict=True)}
    print(f"\n{case}: the reference's piecewise run against its eager run (on "
          f"{spec.reference_ranks} GPUs): {spread:.2e}, so the tolerance is {tolerance:.2e}\n"
          "largest relative error of each run's logits against the reference in the same mode:")
    for name, error in errors.items():
        print(f"  {name:32s} {error:.2e}")
    failed = {name: f"{error:.2e}" for name, error in errors.items() if error > tolerance}
    assert not failed, f"logits beyond {tolerance:.2e}: {failed}"


def largest_error(rows: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(relative_error(ours, ref) for ours, ref in zip(rows, expected, strict=True))


@pytest.mark.parametrize("all_reduce", [NCCL, {}, SYMM_MEM], ids=["nccl", "custom", "symm-mem"])
def test_a_second_engine_in_one_process_captures_like_its_fresh_worker(tmp_path, all_reduce):
    """Rank 0's process compiled its kernels for a first engine; the second engine's worker
    is a new process that has not. Their captures must still run the same collectives (a
    warm-up on one rank alone once left the other waiting until NCCL's watchdog killed it),
    and the second engine generates the first's tokens. The custom all-reduce maps the new
    worker's buffer as the first engine's. With symmetric memory the second
    engine cannot map a buffer with its new worker (torch numbers its exchanges per process,
    and rank 0's process has made some): its rendezvous times out after 30 s, it logs why and
    runs on the custom all-reduce, and its tokens still match (README, Tensor
    parallelism)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    save_tiny_model("nemotron_h", tmp_path)  # attention, Mamba2 and MLP blocks
    tokens = []
    for _ in range(2):
        llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="bfloat16", max_model_len=256,
                  **all_reduce)
        try:
            if not all_reduce:  # the default
                assert tensor_parallel().custom_all_reduce is not None
            outputs = llm.generate([list(p) for p in PROMPTS],
                                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        finally:
            llm.close()
        tokens.append([output.outputs[0].token_ids for output in outputs])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("all_reduce", [NCCL, {}], ids=["nccl", "custom"])
def test_a_worker_dying_in_a_step_is_named(tmp_path, all_reduce):
    """Rank 0 waits for the dead worker's part, in NCCL until its launcher aborts the group
    or in the custom all-reduce's kernel until the launcher releases the wait: the step then
    raises, naming the rank, instead of hanging; and closing the engine ends the abort (it
    returns once rank 0's graphs are gone) instead of giving up on it. Each case in a process
    of its own: the dead worker's GPU memory stays held while its peer's process lives."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    save_tiny_model("qwen3", tmp_path)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=engine_with_a_dying_worker,
                              args=(str(tmp_path), all_reduce, results))
    process.start()
    try:
        outcome = outcome_of(process, results)
    finally:
        process.join(launcher.JOIN_SECONDS)
        if process.is_alive():
            process.kill()
    assert "raised" not in outcome, outcome.get("raised")
    assert outcome["custom all-reduce"] == (all_reduce is not NCCL)
    assert "rank 1 failed: its process exited with code 3" in outcome["error"]
    assert outcome["step seconds"] < FAILURE_SECONDS
    assert outcome["close seconds"] < launcher.ABORT_WAIT_SECONDS
    assert outcome["abandoned"] is None, "close() gave up on the abort"


def outcome_of(process: multiprocessing.Process, results: multiprocessing.queues.Queue) -> dict:
    """What the engine's process put in `results`; a failure naming its exit code if it
    ended (or ran out of time) without putting anything."""
    deadline = time.monotonic() + FAILURE_SECONDS * 3
    while results.empty() and process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        return results.get(timeout=5)
    except queue.Empty:
        pytest.fail(f"the engine's process gave no outcome (exit code {process.exitcode})")


def engine_with_a_dying_worker(folder: str, all_reduce: dict,
                               results: multiprocessing.queues.Queue) -> None:
    """A tp 2 engine whose worker dies in its first step: what the step raised, how long it
    and close() took, and why the group was abandoned (None if it was not); or what raised
    out of place."""
    try:
        results.put(_run_with_a_dying_worker(folder, all_reduce))
    except BaseException as error:  # noqa: BLE001 (the test reports it)
        results.put({"raised": repr(error)})


def _run_with_a_dying_worker(folder: str, all_reduce: dict) -> dict:
    rank_loop.spawned_worker_main = worker_dying_in_a_step
    llm = LLM(folder, tensor_parallel_size=2, dtype="bfloat16", max_model_len=256, **all_reduce)
    outcome = {"custom all-reduce": tensor_parallel().custom_all_reduce is not None,
               "error": "the step did not raise"}
    start = time.monotonic()
    try:
        llm.generate([list(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8),
                     use_tqdm=False)
    except TensorParallelError as raised:
        outcome["error"] = str(raised)
    outcome["step seconds"], closing = time.monotonic() - start, time.monotonic()
    llm.close()
    return {**outcome, "close seconds": time.monotonic() - closing,
            "abandoned": parallel_state._abandoned}

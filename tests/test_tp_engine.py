"""Tensor parallelism through the engine on the CPU (gloo, 2 processes): `LLM(...,
tensor_parallel_size=2)` generates tp 1's greedy tokens with its logprobs (prompt and
sampled) within 1e-5; `bcg serve -tp 2` answers the openai client; a worker that raises at
load or in a step stops the engine with an error naming its rank (no hang); sizes the model
or the machine cannot take are refused before any weight loads."""

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from multiprocessing import Pipe

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

import bcg.runner.model_runner as model_runner
from bcg.config import EngineConfig
from bcg.distributed import launcher, parallel_state, rank_loop
from bcg.distributed.launcher import TensorParallelError, Workers, check_tensor_parallel_size
from bcg.distributed.parallel_state import (
    TensorParallel,
    set_custom_all_reduce,
    spawned_group_store,
)
from bcg.distributed.step_channel import PipeStepChannel
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from bcg.loader.model_source import resolve_model
from tests.dying_worker import FAILURE_SECONDS, worker_dying_in_a_step
from tests.hf_tiny import VOCAB, save_tiny_model
from tests.server_process import free_port, running_server, wait_until_healthy

PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 9))]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3)
TOLERANCE = 1e-5
ENGINE_ARGS = dict(device="cpu", kv_cache_tokens=1024, max_model_len=256)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    overrides = {"vocab_size": VOCAB + 1} if request.param == "llama" else {}  # padded slice
    save_tiny_model(request.param, folder, **overrides)
    return folder


def generate(folder, tp: int, **extra):
    llm = LLM(str(folder), tensor_parallel_size=tp, **ENGINE_ARGS, **extra)
    try:
        check_startup_steps(llm.engine.startup_seconds, tp)
        if tp > 1:  # the workers rank 0 spawned read each step from a pipe
            assert isinstance(llm.engine.runner.step_channel, PipeStepChannel)
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.close()


def check_startup_steps(steps: dict[str, float], tp: int) -> None:
    """Rank 0's start-up parts: its own, and over several ranks the workers' start."""
    wanted = ["tokenizer", "tensor-parallel workers spawned", "tensor-parallel group formed",
              "weights (auto)", "KV cache sized and allocated", "total"]
    if tp == 1:
        wanted = [step for step in wanted if not step.startswith("tensor-parallel")]
    assert [step for step in steps if step in wanted] == wanted
    assert all(seconds >= 0 for seconds in steps.values())
    outermost = [seconds for step, seconds in steps.items() if step != "total" and ">" not in step]
    assert steps["total"] >= sum(outermost)


def logprob_values(positions) -> list[float]:
    return [entry.logprob for position in positions if position
            for _, entry in sorted(position.items())]


def test_tp2_generates_tp1s_tokens_and_logprobs(tiny_folder):
    # Qwen3's ranks overlap their steps: the workers then take each step's sampled tokens,
    # for the next step's inputs, from rank 0 by broadcast. They also ask for the symmetric
    # memory all-reduce, which every rank then declines together on the CPU.
    qwen3 = tiny_folder.name.startswith("qwen3")
    expected = generate(tiny_folder, 1)
    ours = generate(tiny_folder, 2, overlap=qwen3, enable_torch_symm_mem=qwen3)
    for mine, ref in zip(ours, expected, strict=True):
        assert mine.outputs[0].token_ids == ref.outputs[0].token_ids
        for got, want in ((mine.outputs[0].logprobs, ref.outputs[0].logprobs),
                          (mine.prompt_logprobs, ref.prompt_logprobs)):
            got, want = torch.tensor(logprob_values(got)), torch.tensor(logprob_values(want))
            assert got.shape == want.shape
            assert ((got - want).abs().max() / want.abs().max()).item() <= TOLERANCE


@pytest.mark.parametrize("arch,extra", [
    ("qwen3_moe", {"enable_expert_parallel": True}),  # whole experts per rank
    ("nemotron_h", {}),  # each step's plan carries the state slots
])
def test_moe_and_hybrid_generate_tp1s_tokens(tmp_path, arch, extra):
    save_tiny_model(arch, tmp_path)
    expected = generate(tmp_path, 1)
    ours = generate(tmp_path, 2, **extra)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in expected]


def test_serve_tp2_answers_the_openai_client(tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    save_tiny_model("qwen3", tmp_path)
    args = ["--model", str(tmp_path), "-tp", "2", "--max-model-len", "256",
            "--kv-cache-tokens", "1024"]
    with running_server(args) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        reply = client.completions.create(model=str(tmp_path), prompt=PROMPTS[1], max_tokens=5,
                                          temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


SERVE_WITH_A_FAILING_WORKER = """
import sys
from bcg.cli import main
from bcg.distributed import rank_loop
from tests import test_tp_engine

rank_loop.spawned_worker_main = test_tp_engine.worker_failing_in_a_step
sys.exit(main(sys.argv[1:]))
"""


def test_serve_stops_when_a_worker_fails(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    save_tiny_model("qwen3", tmp_path)
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE_WITH_A_FAILING_WORKER, "serve", "--device", "cpu",
             "--host", "127.0.0.1", "--port", str(port), "--model", str(tmp_path), "-tp", "2",
             "--max-model-len", "256", "--kv-cache-tokens", "1024"],
            stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, process, open(log))
        reply = httpx.post(f"{base}/v1/completions", timeout=FAILURE_SECONDS,
                           json={"model": str(tmp_path), "prompt": PROMPTS[1], "max_tokens": 2})
        assert reply.status_code == 500
        code = process.wait(timeout=FAILURE_SECONDS)
    finally:
        process.kill()
    assert code != 0
    assert "rank 1 failed: RuntimeError: injected step failure" in log.read_text()


def _fail_at_load(*args, **kwargs):
    raise RuntimeError("injected load failure")


def worker_failing_at_load(*args):
    model_runner.load_model = _fail_at_load
    rank_loop.spawned_worker_main(*args)


def worker_failing_in_a_step(*args):
    def run_plan(self, plan, score_prompt=None):
        raise RuntimeError("injected step failure")

    model_runner.ModelRunner.run_plan = run_plan
    rank_loop.spawned_worker_main(*args)


def test_a_worker_failing_at_load_is_named(tmp_path, monkeypatch):
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setattr(rank_loop, "spawned_worker_main", worker_failing_at_load)
    start = time.monotonic()
    with pytest.raises(TensorParallelError,
                       match="rank 1 failed: RuntimeError: injected load failure"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_ARGS)
    assert time.monotonic() - start < FAILURE_SECONDS


def test_rank_zeros_rendezvous_listens_before_its_workers_start():
    """Rank 0 serves the group's store on a port the system picks, before it spawns the
    workers: a port found free and bound later was once taken in between (EADDRINUSE)."""
    store = spawned_group_store(2, rank=0)
    assert store.port != 0
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass


def worker_exiting_before_it_joins(config, rank, store_port, reports, steps):
    os._exit(4)  # as one that crashes importing the runner or taking its GPU


def worker_stuck_before_it_joins(config, rank, store_port, reports, steps):
    time.sleep(60)


def test_a_worker_dying_before_the_group_forms_is_named_at_once(tmp_path, monkeypatch):
    """Rank 0 waits for the workers' "joining", not in the group's rendezvous (which named a
    dead worker only at its timeout, here made far longer than the test may take)."""
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setattr(rank_loop, "spawned_worker_main", worker_exiting_before_it_joins)
    monkeypatch.setattr(parallel_state, "SPAWNED_GROUP_TIMEOUT", timedelta(minutes=10))
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed to start: its process exited "
                       "with code 4 before it joined the group"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_ARGS)
    assert time.monotonic() - start < FAILURE_SECONDS


def test_a_worker_silent_before_the_group_forms_is_named_and_ended(tmp_path, monkeypatch):
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setattr(rank_loop, "spawned_worker_main", worker_stuck_before_it_joins)
    monkeypatch.setattr(launcher, "SPAWNED_START_TIMEOUT", timedelta(seconds=2))
    ended = []
    monkeypatch.setattr(launcher.Workers, "close", _recording_close(ended))
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed to start: it did not join the "
                       "group within 2 s"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_ARGS)
    assert time.monotonic() - start < 2 + 15  # then ended at once, not after JOIN_SECONDS
    assert [process.poll() is not None for process in ended] == [True]


def _recording_close(ended: list):
    """`Workers.close` that also records the worker processes it ended."""
    close = launcher.Workers.close

    def recording(self):
        close(self)
        ended.extend(self.processes)

    return recording


def test_a_worker_exiting_before_it_reads_its_arguments_is_named(tmp_path, monkeypatch):
    """Whether rank 0's write of the arguments meets the closed pipe or the worker's end of
    reports comes first, the error names the rank and its exit code."""
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setattr(launcher, "WORKER_PROGRAM", "import os; os._exit(5)")
    with pytest.raises(TensorParallelError,
                       match="rank 1 failed to start: its process exited with code 5"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_ARGS)


def test_a_worker_failing_in_a_step_is_named(tmp_path, monkeypatch):
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setattr(rank_loop, "spawned_worker_main", worker_failing_in_a_step)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_ARGS)
    start = time.monotonic()
    with pytest.raises(TensorParallelError,
                       match="rank 1 failed: RuntimeError: injected step failure"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    with pytest.raises(TensorParallelError, match="rank 1 failed"):  # and stays failed
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.close()
    assert time.monotonic() - start < FAILURE_SECONDS
    assert all(p.poll() is not None for p in llm.engine._workers.processes)  # all ended


def worker_exiting_after_its_first_step(*args):
    keep_samples = model_runner.ModelRunner.keep_samples

    def keep_samples_then_exit(self, num_samples, token_ids=None):
        keep_samples(self, num_samples, token_ids)
        os._exit(5)

    model_runner.ModelRunner.keep_samples = keep_samples_then_exit
    rank_loop.spawned_worker_main(*args)


def test_a_worker_gone_between_steps_is_named_at_the_next_step(tmp_path, monkeypatch):
    """The worker ended while idle: the next step (its write to the worker's pipe, or the
    watcher's report if that came first) raises naming it, at once."""
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setattr(rank_loop, "spawned_worker_main", worker_exiting_after_its_first_step)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_ARGS)
    llm.engine.add_request(PROMPTS[0], PARAMS)
    llm.engine.step()  # the worker's one step
    llm.engine._workers.processes[0].wait(FAILURE_SECONDS)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed: its process exited with code 5"):
        llm.engine.step()
    assert time.monotonic() - start < FAILURE_SECONDS
    llm.close()


def test_a_worker_dying_in_a_step_returns_no_tokens(tmp_path, monkeypatch):
    """As on GPUs, where the aborted NCCL collectives of a dead worker's peers return
    garbage instead of raising: rank 0's collectives here wait for the failure, then return
    without exchanging anything. The step must raise, not hand out those tokens."""
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setattr(rank_loop, "spawned_worker_main", worker_dying_in_a_step)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_ARGS)
    workers = llm.engine._workers

    def all_reduce(self, x):
        workers._failed.wait(FAILURE_SECONDS)
        return x

    def all_gather_last_dim(self, x):
        workers._failed.wait(FAILURE_SECONDS)
        return torch.cat([x] * self.size, dim=-1)

    monkeypatch.setattr(TensorParallel, "all_reduce", all_reduce)
    monkeypatch.setattr(TensorParallel, "all_gather_last_dim", all_gather_last_dim)
    llm.engine.add_request(PROMPTS[0], PARAMS)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed: its process exited with code 3"):
        llm.engine.step()
    assert time.monotonic() - start < FAILURE_SECONDS
    llm.close()


LAUNCHED_WORKER_FAILING = """
import logging
from bcg.config import EngineConfig
from bcg.distributed import rank_loop

def serve_steps(config):
    raise RuntimeError("injected failure")

logging.basicConfig()
rank_loop.serve_steps = serve_steps
rank_loop.launched_worker_main(EngineConfig(device="cpu"))
"""


def test_a_launched_worker_failing_logs_its_rank_and_exits_non_zero():
    done = subprocess.run([sys.executable, "-c", LAUNCHED_WORKER_FAILING],
                          env={**os.environ, "RANK": "1"}, capture_output=True, text=True,
                          timeout=FAILURE_SECONDS)
    assert done.returncode == 1
    assert "tensor-parallel rank 1 failed" in done.stderr
    assert "RuntimeError: injected failure" in done.stderr


UNGUARDED_SCRIPT = """
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams

llm = LLM({folder!r}, tensor_parallel_size=2, device="cpu", kv_cache_tokens=1024,
          max_model_len=256)
outputs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
print("generated", len(outputs[0].outputs[0].token_ids))
"""


def test_a_script_that_builds_the_llm_unguarded_works(tmp_path):
    """The workers import bcg's runner, not the caller's script: no `__main__` guard is
    needed (multiprocessing's spawn ran such a script's engine again in every worker)."""
    save_tiny_model("qwen3", tmp_path / "model")
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT.format(folder=str(tmp_path / "model")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=FAILURE_SECONDS)
    assert done.returncode == 0, done.stderr
    assert "generated 2" in done.stdout


def test_the_failure_abort_warns_without_torchs_api_and_not_after_close(monkeypatch, caplog):
    monkeypatch.delattr(c10d, "_abort_process_group", raising=False)
    workers = Workers(EngineConfig(device="cpu"))
    workers._abort_after_failure()
    workers._abort.join(FAILURE_SECONDS)
    assert "no torch.distributed _abort_process_group" in caplog.text
    caplog.clear()
    workers.close()
    workers._abort_after_failure()
    assert caplog.text == ""


class GraphsHoldingTheAbort:
    """Rank 0's runner and NCCL's abort as they meet after a worker died: the abort returns
    only once the runner's graphs (which captured collectives) are destroyed, or never."""

    def __init__(self, monkeypatch, abort_returns: bool = True, abort_raises: bool = False
                 ) -> None:
        self.events: list[str] = []
        self.graphs_gone = threading.Event()
        self.abort_returns, self.abort_raises = abort_returns, abort_raises
        self.workers = Workers(EngineConfig(device="cpu"))
        self.workers.size, self.workers.nccl, self.workers.runner = 2, True, self
        self.workers._num_threads = torch.get_num_threads()
        monkeypatch.setattr(Workers, "_abort_group", lambda workers: self.abort())
        monkeypatch.setattr(launcher, "destroy_tensor_parallel",
                            lambda: self.events.append("group destroyed"))

    def abort(self) -> None:
        self.events.append("abort begun")
        if self.abort_raises:
            raise RuntimeError("NCCL error: unhandled system error")
        if self.abort_returns:
            self.graphs_gone.wait(FAILURE_SECONDS)
            self.events.append("abort returned")
        else:
            threading.Event().wait()  # NCCL's, for good (a daemon thread)

    def close(self) -> None:  # the runner's
        started = self.workers._abort is not None
        self.events.append("graphs destroyed" + (", the abort started" if started else ""))
        self.graphs_gone.set()

    def failed(self) -> Workers:
        self.workers.failure = (1, "its process exited with code 3")
        return self.workers


@pytest.mark.parametrize("timer_first", [True, False], ids=["timer-then-close", "close"])
def test_close_starts_the_failure_abort_then_destroys_the_graphs_then_waits(monkeypatch,
                                                                             timer_first):
    """NCCL's abort returns only once the graphs that captured its collectives are gone, and
    destroying them waits for a collective stuck on the dead peer until the abort begins:
    close() must begin the abort (or find the timer's), destroy the graphs, then wait for it
    (on two GPUs it waited for the abort first, for good). One abort, whoever starts it."""
    held = GraphsHoldingTheAbort(monkeypatch)
    workers = held.failed()
    if timer_first:
        workers._abort_after_failure()
    workers.close()
    workers._abort_after_failure()  # a timer firing after close(): nothing more
    assert held.events.count("abort begun") == 1
    assert [e for e in held.events if e != "abort begun"] == [
        "graphs destroyed, the abort started", "abort returned", "group destroyed"]


def test_a_clean_close_destroys_the_group_and_a_late_timer_aborts_nothing(monkeypatch):
    held = GraphsHoldingTheAbort(monkeypatch)
    held.workers.close()
    held.workers._abort_after_failure()
    assert held.events == ["graphs destroyed", "group destroyed"]


def test_close_with_a_workers_pipe_broken_treats_the_ranks_as_out_of_step(monkeypatch):
    """The shutdown's write finds a worker gone: close() aborts the group instead of
    destroying it with a dead peer."""
    held = GraphsHoldingTheAbort(monkeypatch)
    receiver, sender = Pipe(duplex=False)
    receiver.close()
    held.step_channel = PipeStepChannel((sender,))
    held.workers.close()
    assert held.events[-2:] == ["abort returned", "group destroyed"]


def test_a_worker_failing_as_close_stops_the_workers_gets_its_group_aborted(monkeypatch):
    """A worker that fails after close() found every rank in step (its report came while
    the workers were told to stop): the group is aborted, not destroyed with a dead peer."""
    held = GraphsHoldingTheAbort(monkeypatch)

    class FailingAsItStops:
        def send_shutdown(self) -> None:
            held.failed()

    held.step_channel = FailingAsItStops()
    held.workers.close()
    assert held.events[-2:] == ["abort returned", "group destroyed"]


def test_an_abort_that_never_returns_leaves_the_group_and_refuses_a_new_one(monkeypatch,
                                                                             caplog):
    monkeypatch.setattr(launcher, "ABORT_WAIT_SECONDS", 0.1)
    monkeypatch.setattr(parallel_state, "_abandoned", None)
    monkeypatch.setattr(parallel_state, "_current", parallel_state.TensorParallel())
    held = GraphsHoldingTheAbort(monkeypatch, abort_returns=False)
    start = time.monotonic()
    held.failed().close()
    assert time.monotonic() - start < FAILURE_SECONDS
    assert "group destroyed" not in held.events
    assert "did not return within 0.1 s after a rank failed" in caplog.text
    refused = "cannot join another tensor-parallel group.*start a new process"
    with pytest.raises(RuntimeError, match=refused):
        parallel_state.init_tensor_parallel(2, "gloo")
    with pytest.raises(RuntimeError, match=refused):  # before any worker is spawned
        Workers(EngineConfig(device="cpu", tensor_parallel_size=2))


def test_an_abort_that_raises_leaves_the_group_and_says_why(monkeypatch, caplog):
    """Destroying a group whose abort failed would wait for the dead peer: close() leaves
    it as it is and logs what the abort raised."""
    monkeypatch.setattr(parallel_state, "_abandoned", None)
    monkeypatch.setattr(parallel_state, "_current", parallel_state.TensorParallel())
    held = GraphsHoldingTheAbort(monkeypatch, abort_raises=True)
    held.failed().close()
    assert "group destroyed" not in held.events
    assert "torch's abort of the NCCL group raised RuntimeError" in caplog.text
    with pytest.raises(RuntimeError, match="cannot join another tensor-parallel group"):
        parallel_state.init_tensor_parallel(2, "gloo")


class Waiting:
    """A custom all-reduce whose kernel waits until released."""

    def __init__(self) -> None:
        self.released = False

    def release_waits(self) -> None:
        self.released = True

    def release(self) -> None:
        pass


def test_a_failed_worker_releases_rank_0s_waits_in_the_custom_all_reduce(monkeypatch):
    """Rank 0 may wait in the custom all-reduce's kernel for a worker that died: recording
    the failure ends those waits (else rank 0's step would never finish), and those of one
    set up after it in the same group (the failure may come as it is set up)."""
    monkeypatch.setattr(parallel_state, "_peer_failed", False)
    workers, current, later = Workers(EngineConfig(device="cpu")), Waiting(), Waiting()
    set_custom_all_reduce(current)
    try:
        workers._record(1, "its process exited with code 1")
        set_custom_all_reduce(later)
    finally:
        set_custom_all_reduce(None)
        workers.close()
    assert current.released and later.released
    assert "rank 1 failed: its process exited" in str(workers.error())


@pytest.mark.parametrize("preset,size,expert_parallel", [
    ("qwen3-32b", 4, False), ("qwen3-32b", 8, False),
    ("qwen3-235b-a22b", 8, False), ("qwen3-235b-a22b", 8, True),
])
def test_the_large_presets_split_at_four_and_eight_ranks(preset, size, expert_parallel):
    config = EngineConfig(model=preset, device="cpu", tensor_parallel_size=size,
                          enable_expert_parallel=expert_parallel)
    check_tensor_parallel_size(config, resolve_model(preset, dummy_weights=True).config)


def test_experts_that_do_not_split_are_refused_before_weights_load(tmp_path):
    save_tiny_model("qwen3_moe", tmp_path, num_experts=6, moe_intermediate_size=30)
    model = resolve_model(str(tmp_path)).config
    whole = EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=4,
                         enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible"):
        check_tensor_parallel_size(whole, model)
    split = EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\) is not divisible"):
        check_tensor_parallel_size(split, model)


def test_expert_parallel_on_a_dense_model_is_named(tmp_path, caplog):
    save_tiny_model("qwen3", tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=2,
                          enable_expert_parallel=True)
    with caplog.at_level("WARNING"):
        check_tensor_parallel_size(config, resolve_model(str(tmp_path)).config)
    assert "enable_expert_parallel has no effect: this model has no experts" in caplog.text


def test_bad_sizes_are_refused_before_weights_load(tmp_path, monkeypatch):
    save_tiny_model("qwen3", tmp_path)  # 4 heads, 2 KV heads, intermediate 96
    monkeypatch.setattr(model_runner, "load_model", _fail_at_load)
    with pytest.raises(ValueError, match="num_attention_heads .4. is not divisible by the "
                                         "tensor-parallel size 3"):
        LLM(str(tmp_path), tensor_parallel_size=3, **ENGINE_ARGS)
    for size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
            LLM(str(tmp_path), tensor_parallel_size=size, **ENGINE_ARGS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="names one GPU"):
        EngineConfig(model=str(tmp_path), device="cuda:1", tensor_parallel_size=2)
    config = EngineConfig(model=str(tmp_path), device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs 2 GPUs on this host but 1 are visible"):
        check_tensor_parallel_size(config, resolve_model(str(tmp_path)).config)

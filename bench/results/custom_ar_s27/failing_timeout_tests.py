"""The custom all-reduce (on by default at tensor parallel on GPUs, `--disable-custom-all-reduce`).

CPU: which tensors it takes, that a released one says its engine is closed, the timeout's
setting, and that on the CPU (gloo, 2 processes) every rank quietly stays on the group's
backend. GPU (2 GPUs, NCCL): its sums equal NCCL's in bf16, fp16 and fp32, eagerly and
replayed from CUDA graphs on fresh data, alone and fused with the residual add and the
RMSNorm; a rank whose peer never arrives gives up waiting once the timeout has passed (and
counts it), and an engine whose worker dies in a step names that worker instead of hanging.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from bcg.distributed.custom_all_reduce import (
    DEFAULT_TIMEOUT_S,
    MAX_ROWS,
    TIMEOUT_ENV,
    PeerAllReduce,
    row_numel,
    timeout_ns,
    use_custom_all_reduce,
)
from bcg.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    set_custom_all_reduce,
    spawned_group_store,
    tensor_parallel,
)
from bcg.utils import free_port
from tests.test_symm_mem import (
    check_fused_eager,
    check_fused_graph_replays,
    check_graph_replays,
    nccl_sum,
)


def cpu_kernel(dtype: torch.dtype = torch.bfloat16) -> PeerAllReduce:
    """The kernel's bookkeeping over plain CPU buffers: enough for `takes`."""
    from bcg.kernels.all_reduce_norm import PeerRows

    buffers = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    rows = PeerRows([b.data_ptr() for b in buffers], [b.data_ptr() for b in buffers], 0,
                    row_numel(dtype), MAX_ROWS, dtype, torch.device("cpu"), timeout_ns())
    return PeerAllReduce(rows, buffers)


def test_it_takes_decode_sized_rows_of_its_dtype():
    kernel, width = cpu_kernel(), row_numel(torch.bfloat16)
    assert kernel.takes(torch.zeros(1, 4096, dtype=torch.bfloat16))
    assert kernel.takes(torch.zeros(MAX_ROWS, width, dtype=torch.bfloat16))
    assert kernel.takes(torch.zeros(2, 3, 512, dtype=torch.bfloat16))  # 6 rows
    assert kernel.takes(torch.zeros(4096, dtype=torch.bfloat16))  # one row
    assert not kernel.takes(torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16))
    assert not kernel.takes(torch.zeros(2, width + 8, dtype=torch.bfloat16))
    assert not kernel.takes(torch.zeros(4, 4096))  # another dtype
    assert not kernel.takes(torch.zeros(0, 8, dtype=torch.bfloat16))
    assert not kernel.takes(torch.zeros(64, 32, dtype=torch.bfloat16).t())  # not contiguous
    residual = torch.zeros(4, 4096, dtype=torch.bfloat16)
    assert kernel.takes_add_rms_norm(residual.clone(), residual)
    assert not kernel.takes_add_rms_norm(residual[:2], residual)


def test_traced_tensors_are_not_taken():
    kernel = cpu_kernel()
    takes = torch.compile(kernel.takes, backend="eager", fullgraph=True)
    assert not takes(torch.zeros(4, 4096, dtype=torch.bfloat16))


def test_a_released_kernel_says_its_engine_is_closed():
    kernel = cpu_kernel()
    kernel.mapped = None  # what release() leaves (it also waits for the GPU)
    with pytest.raises(RuntimeError, match="engine is closed"):
        kernel.takes(torch.zeros(8, dtype=torch.bfloat16))


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert timeout_ns() == int(DEFAULT_TIMEOUT_S * 1e9)
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert timeout_ns() == 2_500_000_000
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='{bad}'"):
            timeout_ns()


def test_the_flag_turns_it_off():
    from bcg.cli import build_parser

    args = build_parser().parse_args(["generate", "--disable-custom-all-reduce", "Hi"])
    assert args.disable_custom_all_reduce is True


def cpu_rank_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(2, "gloo", spawned_group_store(2, rank, port), rank)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("bcg.distributed").addHandler(handler)
    logging.getLogger("bcg.distributed").setLevel(logging.INFO)
    try:
        assert use_custom_all_reduce(True, torch.float32, torch.device("cpu")) is None
        assert tensor_parallel().custom_all_reduce is None
        [message] = [r for r in records if "custom all-reduce" in r.getMessage()]
        assert message.levelno == logging.INFO, "the default must not warn on the CPU"
        assert "needs CUDA devices" in message.getMessage()
        assert "stay on gloo" in message.getMessage()
        x = torch.full((4,), float(rank + 1))
        assert torch.equal(tensor_parallel().all_reduce(x), torch.full((4,), 3.0))
    finally:
        destroy_tensor_parallel()


def test_on_the_cpu_every_rank_stays_on_the_groups_backend():
    mp.spawn(cpu_rank_main, args=(free_port(),), nprocs=2, join=True)


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")


def join_gpu_group(rank: int, port: int) -> torch.device:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(2, "nccl", spawned_group_store(2, rank, port), rank, device)
    return device


def check_rows(kernel: PeerAllReduce, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device, rank: int) -> None:
    generator = torch.Generator().manual_seed(sum(shape) + rank)
    x = torch.randn(*shape, generator=generator).to(device, dtype)
    assert kernel.takes(x), (shape, dtype)
    got = tensor_parallel().all_reduce(x)
    torch.testing.assert_close(got, nccl_sum(x), rtol=0, atol=0, msg=f"{shape} {dtype}")


def gpu_rank_main(rank: int, port: int) -> None:
    device = join_gpu_group(rank, port)
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            kernel = use_custom_all_reduce(True, dtype, device)
            assert kernel is not None, "the custom all-reduce did not set up on two GPUs"
            assert tensor_parallel().custom_all_reduce is kernel
            width = row_numel(dtype)
            for shape in ((1, 4096), (7, 4096), (MAX_ROWS, 4096), (3, width), (2, 3, 512),
                          (1, 4096)):
                check_rows(kernel, shape, dtype, device, rank)
            assert not kernel.takes(torch.zeros(MAX_ROWS + 1, 4096, dtype=dtype, device=device))
            for rows in (4, MAX_ROWS):
                check_graph_replays(kernel, rows, dtype, device, rank)
            for rows in (7, 1, MAX_ROWS, 7, 3):  # the slots alternate per row's call count
                check_fused_eager(kernel, rows, dtype, device, rank)
            check_fused_graph_replays(kernel, dtype, device, rank)
            set_custom_all_reduce(None)
    except BaseException:
        traceback.print_exc()  # leaving the group may wait for the peer: say why first
        raise
    finally:
        destroy_tensor_parallel()


@pytest.mark.gpu
def test_its_sums_equal_nccls_eagerly_and_in_graphs_on_two_gpus():
    two_gpus()
    mp.spawn(gpu_rank_main, args=(free_port(),), nprocs=2, join=True)


SILENT_PEER_TIMEOUT_S = 2


def silent_peer_main(rank: int, port: int) -> None:
    """Rank 1 sets the kernel up and never calls it; rank 0's call must give up waiting
    soon after the timeout and count it."""
    device = join_gpu_group(rank, port)
    kernel = use_custom_all_reduce(True, torch.bfloat16, device)
    assert kernel is not None
    outcome = "ok"
    if rank == 0:
        start = time.monotonic()
        kernel(torch.ones(4, 4096, dtype=torch.bfloat16, device=device))
        torch.cuda.synchronize(device)
        waited, timeouts = time.monotonic() - start, kernel.rows.timeouts.item()
        print(f"rank 0 gave up after {waited:.1f} s, {timeouts} timeouts", flush=True)
        if not (SILENT_PEER_TIMEOUT_S <= waited < 10 * SILENT_PEER_TIMEOUT_S and timeouts):
            outcome = f"it waited {waited:.1f} s and counted {timeouts} timeouts"
    tensor_parallel().barrier()  # the CPU group: rank 1 stays until rank 0 is done
    print(f"rank {rank}: {outcome}", flush=True)
    os._exit(0 if outcome == "ok" else 1)


@pytest.mark.gpu
def test_a_rank_whose_peer_never_arrives_gives_up_after_the_timeout(monkeypatch):
    two_gpus()
    monkeypatch.setenv(TIMEOUT_ENV, str(SILENT_PEER_TIMEOUT_S))
    mp.spawn(silent_peer_main, args=(free_port(),), nprocs=2, join=True)


@pytest.mark.gpu
def test_an_engine_whose_worker_dies_in_a_step_names_it(tmp_path, monkeypatch):
    """The worker exits as its first step begins; rank 0's all-reduce waits for it until
    the timeout, then the step raises the launcher's error naming the worker."""
    from bcg.distributed import rank_loop
    from bcg.distributed.launcher import TensorParallelError
    from bcg.engine.llm import LLM
    from bcg.engine.sampling_params import SamplingParams
    from tests.hf_tiny import save_tiny_model
    from tests.test_tp_engine import worker_dying_in_a_step

    two_gpus()
    save_tiny_model("qwen3", tmp_path)
    monkeypatch.setenv(TIMEOUT_ENV, str(SILENT_PEER_TIMEOUT_S))
    monkeypatch.setattr(rank_loop, "spawned_worker_main", worker_dying_in_a_step)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="bfloat16", max_model_len=128,
              decode_graph_bs="1", prefill_graph_tokens="16,32")
    assert tensor_parallel().custom_all_reduce is not None
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed: its process exited with code 3"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - start < 60
    llm.close()

"""The custom all-reduce (on by default; `--disable-custom-all-reduce`).

CPU: which tensors it takes, that a released one says its engine is closed, that the flag
reaches the engine, and that on the CPU (gloo, 2 processes) every rank stays on the group's
backend: silently for this default, logged for `--enable-torch-symm-mem`. GPU (2 GPUs,
NCCL): its sums equal NCCL's in bf16, fp16 and fp32, eagerly and replayed from CUDA graphs
on fresh data, alone and fused with the residual add and the RMSNorm (bit for bit: two
ranks' sum has one rounding in any order), and so do a row-parallel projection's parts
sent from the skinny kernel's epilogue (bf16 and fp16).
"""

from __future__ import annotations

import logging
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from bcg.distributed import parallel_state
from bcg.distributed.custom_all_reduce import (
    MAX_ROWS,
    PeerAllReduce,
    peer_rows,
    row_numel,
    use_custom_all_reduce,
)
from bcg.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    set_custom_all_reduce,
    spawned_group_store,
    tensor_parallel,
)
from bcg.distributed.symm_mem import use_torch_symm_mem
from bcg.engine.llm import LLM
from bcg.runner import model_runner
from bcg.utils import free_port
from tests.hf_tiny import save_tiny_model
from tests.test_symm_mem import (
    EPS,
    check_fused_eager,
    check_fused_graph_replays,
    check_graph_replays,
    fused_inputs,
    nccl_sum,
    unfused,
)
from tests.test_symm_mem import cpu_kernel as symm_mem_cpu_kernel


def cpu_kernel(dtype: torch.dtype = torch.bfloat16) -> PeerAllReduce:
    """The kernel's bookkeeping over plain CPU buffers: enough for `takes`."""
    buffers = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    return PeerAllReduce(peer_rows([b.data_ptr() for b in buffers], 0, dtype,
                                   torch.device("cpu")), buffers)


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
    assert not kernel.takes_add_rms_norm(residual.clone(), residual.float())


def test_it_takes_a_row_parallel_projection_whose_output_it_takes():
    """`takes_projection_add_rms_norm`: the skinny kernel's rows, one dtype for x, the
    weight and the residual, the residual the projection's output shape and within the
    buffers; else the layer falls back to its projection, then the norm's path."""
    from bcg.distributed.custom_all_reduce import PROJECTION_MAX_ROWS

    kernel, width = cpu_kernel(), row_numel(torch.bfloat16)

    def takes(rows: int, n: int = 4096, k: int = 1024, residual_dtype=torch.bfloat16,
              residual_n: int | None = None) -> bool:
        x = torch.zeros(rows, k, dtype=torch.bfloat16)
        weight = torch.zeros(n, k, dtype=torch.bfloat16)
        residual = torch.zeros(rows, residual_n or n, dtype=residual_dtype)
        return kernel.takes_projection_add_rms_norm(x, weight, residual)

    assert takes(1) and takes(PROJECTION_MAX_ROWS)
    assert not takes(PROJECTION_MAX_ROWS + 1)
    assert not takes(2, residual_n=2048)
    assert not takes(2, residual_dtype=torch.float16)
    assert not takes(2, n=width + 8)


def test_traced_tensors_are_not_taken():
    kernel = cpu_kernel()
    takes = torch.compile(kernel.takes, backend="eager", fullgraph=True)
    assert not takes(torch.zeros(4, 4096, dtype=torch.bfloat16))


@pytest.mark.parametrize("make", [cpu_kernel, symm_mem_cpu_kernel], ids=["custom", "symm-mem"])
def test_a_released_kernel_says_its_engine_is_closed(make, monkeypatch):
    for waits_for_the_gpu in ("synchronize", "ipc_collect"):  # no GPU here
        monkeypatch.setattr(torch.cuda, waits_for_the_gpu, lambda device=None: None)
    kernel = make()
    kernel.release()
    for takes in (kernel.takes, lambda x: kernel.takes_add_rms_norm(x, x),
                  lambda x: kernel.takes_projection_add_rms_norm(x, x, x)):
        with pytest.raises(RuntimeError, match="engine is closed"):
            takes(torch.zeros(2, 8, dtype=torch.bfloat16))


def test_it_is_on_unless_the_flag_turns_it_off():
    from bcg.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "Hi"]).disable_custom_all_reduce is False
    args = parser.parse_args(["generate", "--disable-custom-all-reduce", "Hi"])
    assert args.disable_custom_all_reduce is True


@pytest.mark.parametrize("disabled", [False, True])
def test_the_flag_reaches_the_engine(tmp_path, monkeypatch, disabled):
    asked = []

    def recorded(enabled: bool, dtype: torch.dtype, device: torch.device) -> None:
        asked.append(enabled)

    monkeypatch.setattr(model_runner, "use_custom_all_reduce", recorded)
    save_tiny_model("qwen3", tmp_path)
    LLM(str(tmp_path), device="cpu", kv_cache_tokens=256, max_model_len=64,
        disable_custom_all_reduce=disabled).close()
    assert asked == [not disabled]


def cpu_rank_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    parallel_state._peer_failed = True  # as a late failure of a group before may leave it
    init_tensor_parallel(2, "gloo", spawned_group_store(2, rank, port), rank)
    assert not parallel_state._peer_failed  # a new group starts with its waits kept
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("bcg.distributed").addHandler(handler)
    logging.getLogger("bcg.distributed").setLevel(logging.INFO)
    try:
        assert use_custom_all_reduce(True, torch.float32, torch.device("cpu")) is None
        assert use_torch_symm_mem(True, torch.float32, torch.device("cpu")) is None
        assert tensor_parallel().custom_all_reduce is None
        # on by default: nothing to say where it never runs; the flag asked for is named
        assert not [r for r in records if "custom all-reduce" in r.getMessage()]
        [message] = [r for r in records if "--enable-torch-symm-mem" in r.getMessage()]
        assert message.levelno == logging.WARNING
        assert "does not take effect: it needs CUDA devices" in message.getMessage()
        x = torch.full((4,), float(rank + 1))
        assert torch.equal(tensor_parallel().all_reduce(x), torch.full((4,), 3.0))
    finally:
        destroy_tensor_parallel()


def test_on_the_cpu_every_rank_falls_back_to_the_groups_backend():
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


def check_projected(kernel: PeerAllReduce, rows: int, dtype: torch.dtype,
                    device: torch.device, rank: int) -> None:
    """The projection's parts sent from the skinny kernel's epilogue, then reduced, added
    and normalised: eagerly, then twice in a CUDA graph with a plain all-reduce of the same
    rows between them, replayed on fresh inputs; against the skinny kernel's own output
    summed by NCCL, then `add_rms_norm`."""
    from bcg.kernels.skinny_linear import skinny_linear  # needs Triton: GPU runs only

    def inputs(seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed + rank)
        x = torch.randn(rows, 2048, generator=generator).to(device, dtype)
        return (x, *fused_inputs(rows, dtype, device, rank, seed)[1:])

    weight = (torch.randn(4096, 2048, generator=torch.Generator().manual_seed(7 + rank))
              * 2048**-0.5).to(device, dtype)
    x, residual, norm_weight = inputs(rows)
    assert kernel.takes_projection_add_rms_norm(x, weight, residual), (rows, dtype)
    expected, expected_residual = unfused(skinny_linear(x, weight), residual, norm_weight)
    out, got_residual = kernel.projection_add_rms_norm(x, weight, residual, norm_weight, EPS)
    torch.testing.assert_close(got_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, msg=f"{rows} rows, {dtype}")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    plain = torch.empty(rows, 4096, dtype=dtype, device=device)
    with torch.cuda.graph(graph):
        out, _ = kernel.projection_add_rms_norm(x, weight, residual, norm_weight, EPS)
        summed = kernel(plain)  # the kernel's own send of the same rows between them
        out, _ = kernel.projection_add_rms_norm(x * 0.5, weight, residual, norm_weight, EPS)
    for trial in range(3):
        fresh_x, fresh_residual, _ = inputs(100 + trial)
        x.copy_(fresh_x)
        residual.copy_(fresh_residual)
        plain.copy_(torch.randn(rows, 4096, generator=torch.Generator().manual_seed(
            200 + trial + rank)).to(device, dtype))
        graph.replay()
        torch.testing.assert_close(summed, nccl_sum(plain), rtol=0, atol=0,
                                   msg=f"replay {trial}")
        expected, expected_residual = unfused(skinny_linear(fresh_x, weight), fresh_residual,
                                              norm_weight)
        expected, expected_residual = unfused(skinny_linear(fresh_x * 0.5, weight),
                                              expected_residual, norm_weight)
        torch.testing.assert_close(residual, expected_residual, msg=f"replay {trial}")
        torch.testing.assert_close(out, expected, msg=f"replay {trial}")
    graph.reset()


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
            if dtype != torch.float32:  # the skinny kernel's dtypes
                for rows in (1, 16, 5):
                    check_projected(kernel, rows, dtype, device, rank)
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

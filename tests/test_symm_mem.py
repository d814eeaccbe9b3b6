"""The custom all-reduce through torch symmetric memory (`--enable-torch-symm-mem`).

CPU: which tensors it takes, that `TensorParallel.all_reduce` routes them to it and the rest
to the group, and that a replaced or destroyed one is released (tests/test_custom_all_reduce.py
has the fall-back on the CPU). GPU (2 GPUs, NCCL): the
one-shot and two-shot kernels' sums equal NCCL's, eagerly and replayed from a CUDA graph on
fresh data, in bf16 and fp32 (tests/test_multi_gpu.py runs whole models with it in every
graph mode). The all-reduce fused with the residual add and the RMSNorm equals NCCL's sum
then `add_rms_norm`, over calls of changing row counts up to 256, eagerly and replayed."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bcg.distributed import parallel_state
from bcg.distributed.custom_all_reduce import MAX_ROWS
from bcg.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    set_custom_all_reduce,
    spawned_group_store,
    tensor_parallel,
)
from bcg.distributed.symm_mem import (
    MAX_BYTES,
    ONE_SHOT_MAX_BYTES,
    SymmMemAllReduce,
    _unsupported,
    use_torch_symm_mem,
)
from bcg.utils import free_port

EPS = 1e-6


def cpu_kernel(dtype: torch.dtype = torch.bfloat16) -> SymmMemAllReduce:
    """The kernel's bookkeeping over a plain buffer: enough for `takes`."""
    return SymmMemAllReduce(torch.empty(MAX_BYTES // dtype.itemsize, dtype=dtype), "g")


def test_it_takes_small_aligned_contiguous_tensors_of_its_dtype_and_device():
    kernel = cpu_kernel()
    assert kernel.takes(torch.zeros(4, 4096, dtype=torch.bfloat16))
    assert kernel.takes(torch.zeros(MAX_BYTES // 2, dtype=torch.bfloat16))
    assert not kernel.takes(torch.zeros(MAX_BYTES // 2 + 8, dtype=torch.bfloat16))  # too large
    assert not kernel.takes(torch.zeros(4, 4096))  # another dtype
    assert not kernel.takes(torch.zeros(0, dtype=torch.bfloat16))
    assert not kernel.takes(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes: not 16-aligned
    assert not kernel.takes(torch.zeros(64, 32, dtype=torch.bfloat16).t())  # not contiguous
    assert not kernel.takes(torch.zeros(64, dtype=torch.bfloat16)[1:9])  # a misaligned start


def test_small_messages_take_the_one_shot_kernel_and_larger_ones_the_two_shot(monkeypatch):
    """On the CPU with the kernels faked: the two-shot one reads its input from the buffer,
    so the message must have been copied there."""
    calls = []

    def one_shot(buffer, x, op, group, out):
        calls.append(("one-shot", x.numel()))
        return out.copy_(x * 2)

    def two_shot(buffer, op, group, out):
        calls.append(("two-shot", buffer.numel()))
        return out.copy_(buffer * 2)

    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", one_shot)
    monkeypatch.setattr(torch.ops.symm_mem, "two_shot_all_reduce_out", two_shot)
    kernel = cpu_kernel()
    small = torch.randn(ONE_SHOT_MAX_BYTES // 2).bfloat16()  # the largest one-shot message
    large = torch.randn(2, ONE_SHOT_MAX_BYTES // 4 + 8).bfloat16()
    assert torch.equal(kernel(small), small * 2) and torch.equal(kernel(large), large * 2)
    assert calls == [("one-shot", small.numel()), ("two-shot", large.numel())]


def test_traced_all_reduces_go_through_the_group(monkeypatch):
    """Under torch.compile (piecewise graphs) NCCL's all-reduce, which Inductor lowers; the
    check never reaches the storage a traced tensor does not have (no graph break). On the
    CPU the kernel itself would fail: reaching it fails the test."""
    monkeypatch.setattr(dist, "all_reduce", lambda x, group: x.mul_(2))
    tp = TensorParallel(0, 2, group="world", custom_all_reduce=cpu_kernel())
    all_reduce = torch.compile(tp.all_reduce, backend="eager", fullgraph=True)
    x = torch.ones(4096, dtype=torch.bfloat16)
    assert torch.equal(all_reduce(x.clone()), x * 2)


def test_a_torch_without_the_ops_is_declined_not_an_error(monkeypatch):
    monkeypatch.setattr("bcg.distributed.symm_mem.ONE_SHOT", "symm_mem::no_such_op")
    reason = _unsupported(TensorParallel(0, 2), torch.bfloat16, torch.device("cuda", 0))
    assert "no CUDA kernel for symm_mem::no_such_op" in reason


def test_float16_and_ranks_on_several_hosts_are_declined(monkeypatch):
    tp, gpu = TensorParallel(0, 2), torch.device("cuda", 0)
    assert "not torch.float16" in _unsupported(tp, torch.float16, gpu)
    if not torch._C._dispatch_has_kernel_for_dispatch_key("symm_mem::one_shot_all_reduce_copy_out",
                                                          "CUDA"):
        assert "no CUDA kernel" in _unsupported(tp, torch.bfloat16, gpu)
        return
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert "several hosts" in _unsupported(tp, torch.bfloat16, gpu)


class FakeKernel:
    """Takes tensors of at most `largest` elements; counts calls and releases."""

    def __init__(self, largest: int) -> None:
        self.largest, self.calls, self.released = largest, 0, 0

    def takes(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.largest

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2  # what two ranks holding the same x sum to

    def release(self) -> None:
        self.released += 1


def test_all_reduce_sends_what_the_kernel_takes_to_it_and_the_rest_to_the_group(monkeypatch):
    group_calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group: group_calls.append(x.numel()))
    kernel = FakeKernel(largest=8)
    tp = TensorParallel(0, 2, group="world", custom_all_reduce=kernel)
    small, large = torch.ones(8), torch.ones(9)
    assert torch.equal(tp.all_reduce(small), small * 2) and kernel.calls == 1
    assert tp.all_reduce(large) is large and group_calls == [9]  # in place, through the group


class FakeFusedKernel(FakeKernel):
    """Also runs the all-reduce + add + norm for at most `largest_fused` rows."""

    def __init__(self, largest: int, largest_fused: int) -> None:
        super().__init__(largest)
        self.largest_fused, self.fused_calls = largest_fused, 0

    def takes_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return x.shape[0] <= self.largest_fused

    def add_rms_norm(self, x, residual, weight, eps):
        self.fused_calls += 1
        residual += x * 2
        return weight * residual, residual


def test_a_norm_after_a_ranks_part_takes_the_fused_kernel_where_it_can(monkeypatch):
    """`RMSNorm.add_and_norm` with a group: the fused kernel for what it takes, else the
    all-reduce (kernel or group) then the add and the norm; the first layer's norm, with
    no residual yet, never fuses."""
    from bcg.layers.norm import RMSNorm

    monkeypatch.setattr(dist, "all_reduce", lambda x, group: x.mul_(2))
    kernel = FakeFusedKernel(largest=8, largest_fused=2)
    tp = TensorParallel(0, 2, group="world", custom_all_reduce=kernel)
    norm = RMSNorm(4, eps=1e-6)
    for rows, fused in ((2, True), (3, False), (1, True)):
        x, residual = torch.randn(rows, 4), torch.randn(rows, 4)
        calls_before = kernel.fused_calls
        if fused:  # what the fake kernel returns
            expected = (norm.weight * (residual + x * 2), residual + x * 2)
        else:  # 12 elements: past the fake's all-reduce too, so the group's
            expected = norm.add_and_norm(x * 2, residual.clone())
        got = norm.add_and_norm(x.clone(), residual.clone(), tp)
        assert kernel.fused_calls - calls_before == fused and kernel.calls == 0
        torch.testing.assert_close(got, expected)
    out, residual = norm.add_and_norm(torch.ones(1, 4), None, tp)  # 4 elements: the kernel
    assert kernel.calls == 1 and torch.equal(residual, torch.full((1, 4), 2.0))
    assert kernel.fused_calls == 2


def test_a_replaced_or_destroyed_kernel_is_released():
    first, second = FakeKernel(8), FakeKernel(8)
    try:
        set_custom_all_reduce(first)
        set_custom_all_reduce(first)  # the same one again: kept
        assert first.released == 0
        set_custom_all_reduce(second)
        assert (first.released, tensor_parallel().custom_all_reduce) == (1, second)
        destroy_tensor_parallel()
        assert second.released == 1 and tensor_parallel().custom_all_reduce is None
    finally:
        parallel_state._current = TensorParallel()


def test_a_single_rank_ignores_the_flag(caplog):
    with caplog.at_level(logging.INFO, logger="bcg.distributed.symm_mem"):
        use_torch_symm_mem(True, torch.float32, torch.device("cpu"))
    assert tensor_parallel().custom_all_reduce is None
    assert "no effect on a single rank" in caplog.text


def gpu_rank_main(rank: int, port: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(2, "nccl", spawned_group_store(2, rank, port), rank, device)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            kernel = use_torch_symm_mem(True, dtype, device)
            assert kernel is not None, "symmetric memory did not set up on two GPUs"
            assert tensor_parallel().custom_all_reduce is kernel
            one_shot = ONE_SHOT_MAX_BYTES // dtype.itemsize
            for numel in (8, 4096, 7 * 4096, one_shot, one_shot + 8, 256 * 4096 + 8,
                          MAX_BYTES // dtype.itemsize):
                check_eager(kernel, numel, dtype, device, rank)
            for rows in (4, 256):  # one-shot, two-shot
                check_graph_replays(kernel, rows, dtype, device, rank)
            for rows in (7, 1, MAX_ROWS, 7, 3):  # the slots alternate per row's call count
                check_fused_eager(kernel, rows, dtype, device, rank)
            check_fused_graph_replays(kernel, dtype, device, rank)
            set_custom_all_reduce(None)
    finally:
        destroy_tensor_parallel()


def nccl_sum(x: torch.Tensor) -> torch.Tensor:
    expected = x.clone()
    dist.all_reduce(expected)
    return expected


def check_eager(kernel: SymmMemAllReduce, numel: int, dtype: torch.dtype, device: torch.device,
                rank: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + rank)).to(device, dtype)
    assert kernel.takes(x), (numel, dtype)
    got = tensor_parallel().all_reduce(x)
    torch.testing.assert_close(got, nccl_sum(x), rtol=0, atol=0, msg=f"{numel} x {dtype}")


def check_graph_replays(kernel: SymmMemAllReduce, rows: int, dtype: torch.dtype,
                        device: torch.device, rank: int) -> None:
    """Three all-reduces of `rows` x 4096 in a row (the buffer reused by each), captured
    once, replayed on fresh inputs: each replay sums the inputs it was given."""
    static = torch.zeros(rows, 4096, dtype=dtype, device=device)
    assert kernel.takes(static)
    tp = tensor_parallel()
    tp.all_reduce(static)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.all_reduce(tp.all_reduce(tp.all_reduce(static)) * 0.5)
    for trial in range(3):
        fresh = torch.randn(rows, 4096,
                            generator=torch.Generator().manual_seed(10 * trial + rank))
        static.copy_(fresh.to(dtype))
        graph.replay()
        expected = nccl_sum(nccl_sum(nccl_sum(static)) * 0.5)
        torch.testing.assert_close(out, expected, rtol=0, atol=0,
                                   msg=f"replay {trial}, {rows} rows, {dtype}")
    graph.reset()


def fused_inputs(rows: int, dtype: torch.dtype, device: torch.device, rank: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's part, and the residual and norm weight every rank holds alike."""
    def draw(*shape: int, salt: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed + salt)
        return torch.randn(*shape, generator=generator).to(device, dtype)

    return draw(rows, 4096, salt=100 + rank), draw(rows, 4096), draw(4096, salt=50)


def unfused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    from bcg.kernels.rmsnorm import add_rms_norm  # needs Triton: GPU runs only

    return add_rms_norm(nccl_sum(x), residual.clone(), weight, EPS)


def check_fused_eager(kernel: SymmMemAllReduce, rows: int, dtype: torch.dtype,
                      device: torch.device, rank: int) -> None:
    x, residual, weight = fused_inputs(rows, dtype, device, rank, seed=rows)
    assert kernel.takes_add_rms_norm(x, residual), (rows, dtype)
    expected_out, expected_residual = unfused(x, residual, weight)
    out, got_residual = kernel.add_rms_norm(x, residual, weight, EPS)
    assert got_residual is residual
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0,
                               msg=f"{rows} rows, {dtype}")
    torch.testing.assert_close(out, expected_out, msg=f"{rows} rows, {dtype}")


def check_fused_graph_replays(kernel: SymmMemAllReduce, dtype: torch.dtype,
                              device: torch.device, rank: int) -> None:
    """Three fused calls in a row (both slots, then the first again), captured once and
    replayed on fresh inputs."""
    x, residual, weight = fused_inputs(5, dtype, device, rank, seed=0)
    kernel.add_rms_norm(x, residual.clone(), weight, EPS)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = kernel.add_rms_norm(x, residual, weight, EPS)
        out, _ = kernel.add_rms_norm(x * 0.5, residual, weight, EPS)
        out, _ = kernel.add_rms_norm(out, residual, weight, EPS)
    for trial in range(3):
        fresh_x, fresh_residual, _ = fused_inputs(5, dtype, device, rank, seed=1 + trial)
        x.copy_(fresh_x)
        residual.copy_(fresh_residual)
        graph.replay()
        expected, expected_residual = unfused(fresh_x, fresh_residual, weight)
        expected, expected_residual = unfused(fresh_x * 0.5, expected_residual, weight)
        expected, expected_residual = unfused(expected, expected_residual, weight)
        torch.testing.assert_close(residual, expected_residual, msg=f"replay {trial}")
        torch.testing.assert_close(out, expected, msg=f"replay {trial}")
    graph.reset()


@pytest.mark.gpu
def test_the_kernel_sums_as_nccl_does_eagerly_and_in_graphs_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    mp.spawn(gpu_rank_main, args=(free_port(),), nprocs=2, join=True)


class FakeProjectingKernel(FakeFusedKernel):
    """Also runs a row-parallel projection with the all-reduce + add + norm after it, for
    at most `largest_fused` rows; counts those calls."""

    def __init__(self) -> None:
        super().__init__(largest=8, largest_fused=2)
        self.projected = 0

    def takes_projection_add_rms_norm(self, x, weight, residual) -> bool:
        return x.shape[0] <= self.largest_fused

    def projection_add_rms_norm(self, x, weight, residual, norm_weight, eps):
        self.projected += 1
        return self.add_rms_norm(x @ weight.T, residual, norm_weight, eps)


def test_a_row_parallel_projection_on_the_skinny_kernel_sends_its_part_itself(monkeypatch):
    """`RowParallelLinear.add_and_norm`: where the skinny kernel takes the step and the
    custom all-reduce the projection, one call of the kernel's projection + reduce; else the
    projection, then the norm's path (here the group's all-reduce, then add and norm)."""
    from bcg.layers import linear, triton_ops
    from bcg.layers.norm import RMSNorm

    monkeypatch.setattr(triton_ops, "uses_skinny_linear",
                        lambda x, weight, activation=None: x.shape[0] <= 2)
    monkeypatch.setattr(dist, "all_reduce", lambda x, group: x.mul_(2))
    kernel = FakeProjectingKernel()
    tp = TensorParallel(0, 2, group="world", custom_all_reduce=kernel)
    monkeypatch.setattr(linear, "tensor_parallel", lambda: tp)
    layer, norm = linear.RowParallelLinear(8, 4), RMSNorm(4, eps=1e-6)
    layer.weight.data = torch.randn(4, 4)
    for rows, projected in ((2, True), (3, False)):
        x, residual = torch.randn(rows, 4), torch.randn(rows, 4)
        summed = x @ layer.weight.T * 2
        expected = ((norm.weight * (residual + summed), residual + summed) if projected
                    else norm.add_and_norm(summed, residual.clone()))
        before = kernel.projected
        got = layer.add_and_norm(x, residual.clone(), norm)
        assert kernel.projected - before == projected
        torch.testing.assert_close(got, expected)

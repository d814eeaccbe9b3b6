"""Our Mamba2 kernels (causal conv, its one-token update, the chunked scan, the selective
state update) against the PyTorch references on the same inputs: outputs and the states they
leave. CPU: Triton's interpreter, fp32, small shapes; GPU: bf16 and fp32 over varlen batches
at NemotronH-8B's head shapes (fp32 well inside TF32's ~1e-3: the scan's dots are exact
("ieee") for fp32 inputs)."""

import pytest
import torch

from bcg.layers import mamba_ref
from tests.kernels_support import DEVICE, ON_GPU, import_kernels, record_launches
from tests.mamba_batch import MambaBatch, make_mamba_batch
from tests.numerics import relative_error

conv = import_kernels("mamba_conv")
scan = import_kernels("mamba_scan")

DT_LIMIT = (0.2, 1.5)  # binds on both sides for some tokens
SMALL = dict(heads=4, head_dim=8, groups=2, state_size=16, taps=4, num_slots=6)
LARGE = dict(heads=16, head_dim=64, groups=2, state_size=128, taps=4, num_slots=12)
# (dtype, tolerance): bf16 inputs against the fp32 reference on the same bf16 inputs.
GPU_RUNS = [pytest.param((torch.bfloat16, 2e-2), id="bf16", marks=pytest.mark.gpu),
            pytest.param((torch.float32, 2e-4), id="fp32", marks=pytest.mark.gpu)]
CPU_RUN = [pytest.param((torch.float32, 1e-4), id="interpreter-fp32")]
RUNS = GPU_RUNS if ON_GPU else CPU_RUN
# (new tokens, prefix, slot) per sequence: fresh, cached, slotless, shorter than the conv
# window, several scan chunks; a decode row among prefills. Decode: a one-token prompt (its
# slot's stale state unread) and padding rows (slot -1).
PREFILL = [(1, 0, 0), (2, 5, 2), (37, 0, -1), (20, 11, 4), (1, 30, 5), (70, 3, 1)]
DECODE = [(1, 9, 3), (1, 1, -1), (1, 4, 0), (1, 0, 2), (1, 17, 5), (1, 2, -1)]


def make(rows: list[tuple[int, int, int]], shapes: dict, dtype: torch.dtype,
         seed: int) -> MambaBatch:
    new, prefix, slots = (list(column) for column in zip(*rows, strict=True))
    return make_mamba_batch(new, prefix, slots, **shapes,
                            generator=torch.Generator().manual_seed(seed), device=DEVICE,
                            dtype=dtype)


def run(batch: MambaBatch, decode: bool, ops, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """(activated, y, conv_state, ssm_state) of the conv then the scan through `ops`
    (conv, conv_update, scan, state_update), on copies of the states."""
    conv_state, ssm_state = batch.conv_state.clone(), batch.ssm_state.clone()
    activated = torch.full_like(batch.xbc, float("nan"))
    weights = (batch.xbc, batch.conv_weight, batch.conv_bias, conv_state)
    if decode:
        ops[1](*weights, batch.seq_lens, batch.state_slots, activated)
    else:
        ops[0](*weights, batch.cu_seqlens, batch.seq_lens, batch.state_slots, activated)
    x, B, C = batch.split(activated)
    y = torch.full_like(x, float("nan"))
    common = (x, batch.dt, batch.A, B, C, batch.D, batch.dt_bias, DT_LIMIT)
    if decode:
        ops[3](*common, ssm_state, batch.seq_lens, batch.state_slots, y)
    else:
        ops[2](*common, chunk_size, ssm_state, batch.cu_seqlens, batch.seq_lens,
               batch.state_slots, y)
    return activated, y, conv_state, ssm_state


KERNELS = (conv.causal_conv1d_varlen, conv.causal_conv1d_update, scan.ssd_scan_varlen,
           scan.selective_state_update)
REFERENCES = (mamba_ref.causal_conv1d_ref, mamba_ref.causal_conv1d_update_ref,
              mamba_ref.ssd_scan_ref, mamba_ref.selective_state_update_ref)


def compare(batch: MambaBatch, decode: bool, tolerance: float, chunk_size: int = 8) -> None:
    ours = run(batch, decode, KERNELS, chunk_size)
    expected = run(batch, decode, REFERENCES, chunk_size)
    names = ("activated", "y", "conv_state", "ssm_state")
    for name, mine, ref in zip(names, ours, expected, strict=True):
        assert not mine.isnan().any(), f"{name}: rows left unwritten"
        assert relative_error(mine, ref) <= tolerance, name


# The kernel's chunk follows chunk_size up to its own: 16, 32 and 64 tokens on the GPU.
@pytest.mark.parametrize("chunk_size", [8, 32, 128])
@pytest.mark.parametrize("run_config", RUNS)
def test_prefill_varlen(run_config, chunk_size):
    dtype, tolerance = run_config
    shapes = LARGE if ON_GPU else SMALL
    compare(make(PREFILL, shapes, dtype, seed=0), decode=False, tolerance=tolerance,
            chunk_size=chunk_size)


@pytest.mark.parametrize("run_config", RUNS)
def test_decode_with_padding_rows(run_config):
    dtype, tolerance = run_config
    shapes = LARGE if ON_GPU else SMALL
    compare(make(DECODE, shapes, dtype, seed=1), decode=True, tolerance=tolerance)


def test_scan_dots_are_exact_for_fp32_inputs(monkeypatch):
    """fp32 inputs take "ieee" dots (not TF32); bf16 and fp16 ones keep the tensor cores."""
    launches = record_launches(monkeypatch, scan, "_launch_scan")
    compare(make(PREFILL[:3], SMALL, torch.float32, seed=3), decode=False, tolerance=1e-4)
    assert {constexprs["DOT_PRECISION"] for constexprs, _ in launches} == {"ieee"}
    assert scan._dot_precision(torch.bfloat16) == scan._dot_precision(torch.float16) == "tf32"


@pytest.mark.gpu
def test_prefill_one_long_sequence_nemotron_8b_heads():
    """One 1000-token prompt over a cached state, 8B's per-rank shapes at tp 2."""
    shapes = dict(heads=64, head_dim=64, groups=4, state_size=128, taps=4, num_slots=2)
    compare(make([(1000, 16, 1)], shapes, torch.bfloat16, seed=2), decode=False,
            tolerance=2e-2, chunk_size=128)

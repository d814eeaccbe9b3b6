"""The linear layers, the logits head and the MLP through the skinny kernel (the interpreter
on the CPU, fp32): a tiny Llama's and a tiny NemotronH's logits with decode-sized steps on
the kernel, the MLP's activation fused into its first projection (SiLU-and-mul of gate/up,
squared ReLU of up), match those of PyTorch's matmuls. On CUDA the layers take the kernel for
steps of up to 16 rows in bf16 and fp16 (`triton_ops.uses_skinny_linear`)."""

import pytest
import torch

from bcg.layers import triton_ops
from tests.hf_tiny import save_tiny_model
from tests.kernels_support import import_kernels
from tests.numerics import relative_error
from tests.split_runs import step_logits

skinny = import_kernels("skinny_linear")


@pytest.mark.parametrize("model, activation", [("llama", "silu_and_mul"),
                                               ("nemotron_h", "relu_squared")])
def test_decode_steps_on_the_kernel_give_pytorchs_logits(tmp_path, monkeypatch, model,
                                                         activation):
    save_tiny_model(model, tmp_path)
    expected, _ = step_logits(str(tmp_path))
    taken, fused = [], set()

    def decode_sized(x: torch.Tensor, weight: torch.Tensor,
                     fused_activation: str | None = None) -> bool:
        # CUDA's rows rule
        taken.append(x.shape[0] <= skinny.MAX_ROWS)
        if taken[-1]:
            fused.add(fused_activation)
        return taken[-1]

    monkeypatch.setattr(triton_ops, "uses_skinny_linear", decode_sized)
    ours, _ = step_logits(str(tmp_path))
    assert any(taken) and not all(taken)  # the decodes took it, the 26-token prefill not
    assert activation in fused
    for got, want in zip(ours, expected, strict=True):
        assert relative_error(got, want) <= 1e-4

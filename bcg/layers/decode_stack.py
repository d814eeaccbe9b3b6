"""A dense Llama-family stack's decode step of one sequence as one launch
(`bcg.kernels.decode_stack`), where the model, the device and the step allow it.

It runs in the steps a decode graph of batch size 1 captures (and their eager form): one
sequence adding one token, on CUDA, without tensor parallelism, in a 16-bit dtype, for a model
whose layers are all attention with rotary + gated MLP, without biases. Any other step runs the
layers one by one. `BCG_DECODE_STACK=0` in the environment turns it off, to compare.
"""

from __future__ import annotations

import torch
from torch import nn

from bcg.distributed.parallel_state import tensor_parallel
from bcg.forward import get_forward_context
from bcg.layers import triton_ops
from bcg.layers.norm import RMSNorm
from bcg.layers.rotary import RotaryEmbedding
from bcg.utils import switch_from_environment

SWITCHED_ON = switch_from_environment("BCG_DECODE_STACK")


class FusedDecodeStack:
    """The layers of a `LlamaModel` as the fused kernel takes them: `prepare()` once the
    weights are loaded, then `runs(hidden)` says whether a forward may use it and `__call__`
    runs every layer and the final norm."""

    def __init__(self, layers: nn.ModuleList, final_norm: RMSNorm,
                 rotary: RotaryEmbedding) -> None:
        self.layers, self.final_norm, self.rotary = layers, final_norm, rotary
        self._shape = None
        self._table: torch.Tensor | None = None
        self._workspace = None

    def prepare(self) -> None:
        """Build the weight table and the buffers, where the stack can run: at load time,
        outside any graph capture, so no captured graph or break owns them."""
        weight = self.final_norm.weight
        if not (SWITCHED_ON and weight.is_cuda and weight.dtype in (torch.bfloat16,
                                                                   torch.float16)):
            return
        if tensor_parallel().size != 1 or not all(_plain(layer) for layer in self.layers):
            return
        shape = _shape(self.layers, self.final_norm)
        programs = triton_ops.multiprocessor_count(weight.device)
        if triton_ops.decode_stack_unsupported(shape, programs) is not None:
            return
        weights = [_layer_weights(layer) for layer in self.layers]
        if any(w.dtype != weight.dtype or not w.is_contiguous() for row in weights for w in row):
            return  # the kernel reads [out, in] matrices in the activations' dtype
        self._shape = shape
        self._table = torch.tensor([[w.data_ptr() for w in row] for row in weights],
                                   dtype=torch.int64, device=weight.device)
        self._workspace = triton_ops.make_decode_stack_workspace(shape, weight.dtype, weight.device)

    def runs(self, hidden: torch.Tensor) -> bool:
        """Whether this forward (embedded tokens `hidden`) runs as one launch."""
        if not (SWITCHED_ON and self._workspace is not None and hidden.shape[0] == 1
                and hidden.dtype == self.final_norm.weight.dtype
                and not torch.compiler.is_compiling()):
            return False
        context = get_forward_context()
        # A decode step, and not inside a prefill graph (its segments serve any batch).
        return context.rotary_may_store_kv and context.batch.is_decode

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every layer on `hidden` (in place), then the final norm."""
        context = get_forward_context()
        batch = context.batch
        triton_ops.decode_stack(
            hidden, positions, batch.slot_mapping, batch.seq_lens, batch.block_tables,
            self._table, context.kv_cache.storage, self.rotary.cos, self.rotary.sin,
            self._workspace, self._shape, self.final_norm.eps)
        return self.final_norm(hidden)


def _shape(layers: nn.ModuleList, final_norm: RMSNorm):
    attention = layers[0].self_attn
    return triton_ops.StackShape(
        num_layers=len(layers), hidden=final_norm.weight.shape[0],
        num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        intermediate=layers[0].mlp.gate_up_proj.weight.shape[0] // 2,
        qk_norm=attention.qk_norms is not None)


def _layer_weights(layer: nn.Module) -> list[torch.Tensor]:
    """A layer's weights in `bcg.kernels.decode_stack.WEIGHTS` order (loading copies into the
    same parameters, so their addresses stay valid)."""
    attention, mlp = layer.self_attn, layer.mlp
    # Without per-head norms the kernel loads these two (head_dim weights each) but does not
    # apply them; the input norm (hidden >= head_dim weights) stands in.
    q_norm, k_norm = attention.qk_norms or (layer.input_layernorm, layer.input_layernorm)
    return [attention.qkv_proj.weight, attention.o_proj.weight, mlp.gate_up_proj.weight,
            mlp.down_proj.weight, layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight, q_norm.weight, k_norm.weight]


def _plain(layer: nn.Module) -> bool:
    """Attention with rotary and a gated SiLU MLP, no biases: what the kernel computes."""
    attention, mlp = layer.self_attn, layer.mlp
    projections = (attention.qkv_proj, attention.o_proj, getattr(mlp, "gate_up_proj", None),
                   getattr(mlp, "down_proj", None))
    return attention.rotary is not None and all(
        p is not None and p.bias is None for p in projections)

"""The Mamba2 mixer (NemotronH's `M` layers): a graph break like attention, over per-sequence
recurrent state instead of the paged KV cache.

`in_proj` gives z | x | B | C | dt per token. The causal conv over x | B | C and the SSM scan
read and write each sequence's state slots, so they run behind one with-output break
(`step_op`) that reads the live batch and the state cache from the forward context: eager
in breakable prefill graphs, captured inside full decode graphs. The projections, the gated
norm and `out_proj` are token-wise and stay in the graph segments. What crosses the break
(the projection and the scan's output) lives in layer-shared bridge buffers. Split across
ranks by heads and groups: z, x, dt and the norm by heads, B and C by groups, each rank
keeping whole groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bcg.distributed.parallel_state import tensor_parallel
from bcg.forward import get_forward_context
from bcg.graph import bridge_buffer
from bcg.layers.linear import ColumnParallelLinear, RowParallelLinear, load_rank_blocks
from bcg.layers.norm import GatedRMSNorm, RMSNorm
from bcg.layers.step_op import step_op
from bcg.models.config import MambaConfig


class DepthwiseConv(nn.Module):
    """The causal conv's per-channel taps `[channels, K]` (the checkpoint's `[C, 1, K]`),
    split across ranks block by block (x | B | C)."""

    def __init__(self, block_sizes: list[int], kernel: int, bias: bool) -> None:
        super().__init__()
        self.block_sizes = block_sizes
        local = sum(size // tensor_parallel().size for size in block_sizes)
        self.weight = nn.Parameter(torch.empty(local, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(local), requires_grad=False) if bias else None

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        param = getattr(self, name.rpartition(".")[2])
        if loaded.dim() == 3:
            loaded = loaded.squeeze(1)
        load_rank_blocks(name, param.data, loaded, self.block_sizes)

    def fill_dummy(self, name: str, draw: Callable[..., torch.Tensor]) -> None:
        """Random taps (`draw(shape)`) for every channel, this rank's kept."""
        param = getattr(self, name.rpartition(".")[2])
        self.load_weight(name, draw((sum(self.block_sizes), *param.shape[1:])))


class MambaMixer2(nn.Module):
    def __init__(self, hidden_size: int, config: MambaConfig, eps: float,
                 state_index: int) -> None:
        super().__init__()
        tp = tensor_parallel()
        self.state_index = state_index  # which of the state cache's layers is ours
        self.num_heads = tp.shard(config.num_heads, "mamba_num_heads")[1]
        self.n_groups = tp.shard(config.n_groups, "n_groups (Mamba groups)")[1]
        self.head_dim, self.state_size = config.head_dim, config.state_size
        self.chunk_size, self.dt_limit = config.chunk_size, config.dt_limit
        self.inner_size = self.num_heads * self.head_dim
        groups_size = config.n_groups * config.state_size
        conv_blocks = [config.inner_size, groups_size, groups_size]
        self.conv_dim = sum(conv_blocks) // tp.size
        self.in_proj = ColumnParallelLinear(
            hidden_size, [config.inner_size, *conv_blocks, config.num_heads],
            bias=config.proj_bias)
        self.conv1d = DepthwiseConv(conv_blocks, config.conv_kernel, config.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        # -exp(A_log) in fp32, derived once after loading (not per layer per step).
        self.register_buffer("A", torch.empty(self.num_heads, dtype=torch.float32),
                             persistent=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.norm = GatedRMSNorm(config.inner_size, config.inner_size // config.n_groups, eps,
                                 self.inner_size)
        self.out_proj = RowParallelLinear(config.inner_size, hidden_size, bias=config.proj_bias)
        self._full_heads = config.num_heads

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        """dt_bias, A_log and D: this rank's heads."""
        param = getattr(self, name.rpartition(".")[2])
        load_rank_blocks(name, param.data, loaded, [self._full_heads])

    def fill_dummy(self, name: str, draw: Callable[..., torch.Tensor]) -> None:
        """Random dt_bias, A_log and D (`draw(shape)`) for every head, this rank's kept."""
        self.load_weight(name, draw((self._full_heads,)))

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        self.A.copy_(-torch.exp(self.A_log.float()))

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, hidden]` -> the mixer's output added to `residual`, then normalised by
        `norm`: `(normed, residual)`; T >= the live token count (rows past it are graph
        padding: they touch no state and their output is never read)."""
        tokens, dtype, device = hidden_states.shape[0], hidden_states.dtype, hidden_states.device
        shape = (tokens, self.in_proj.weight.shape[0])
        projected = self.in_proj(hidden_states,
                                 out=bridge_buffer("mamba_in_proj", shape, dtype, device))
        output = bridge_buffer("mamba_output", (tokens, self.inner_size), dtype, device)
        if output is None:
            output = hidden_states.new_empty(tokens, self.inner_size)
        mix(self, projected, output)
        gate = projected[:, : self.inner_size]
        return self.out_proj.add_and_norm(self.norm(output, gate), residual, norm)


def _mix(layer: MambaMixer2, projected: torch.Tensor, output: torch.Tensor) -> None:
    context = get_forward_context()
    n = context.batch.num_tokens
    context.mamba.forward(layer, projected[:n], output[:n], context)


mix = step_op(_mix)

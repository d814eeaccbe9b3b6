"""Random varlen batches for the Mamba2 state ops (a helper module: no tests here), laid out
as the mixer hands them over: x | B | C and dt are views into one projection row."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MambaBatch:
    xbc: torch.Tensor  # [T, conv_dim] (a view into the projection)
    dt: torch.Tensor  # [T, H] (a view into the projection)
    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor
    A: torch.Tensor  # [H], negative
    D: torch.Tensor
    dt_bias: torch.Tensor
    conv_state: torch.Tensor  # [slots, K - 1, conv_dim]
    ssm_state: torch.Tensor  # [slots, H, P, N] fp32
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    heads: int
    head_dim: int
    groups: int
    state_size: int

    def split(self, activated: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x `[T, H, P]`, B, C `[T, G, N]` of the conv's output."""
        tokens, inner = activated.shape[0], self.heads * self.head_dim
        groups_size = self.groups * self.state_size
        x, B, C = activated.split([inner, groups_size, groups_size], dim=-1)
        return (x.view(tokens, self.heads, self.head_dim),
                B.view(tokens, self.groups, self.state_size),
                C.view(tokens, self.groups, self.state_size))


def make_mamba_batch(new_lens: list[int], prefix_lens: list[int], slots: list[int],
                     heads: int, head_dim: int, groups: int, state_size: int, taps: int,
                     num_slots: int, generator: torch.Generator, device: torch.device,
                     dtype: torch.dtype) -> MambaBatch:
    """Sequence i adds `new_lens[i]` tokens after `prefix_lens[i]` (> 0: it starts from the
    state in `slots[i]`); slot -1 keeps no state. Every slot starts with random state."""
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    conv_dim = heads * head_dim + 2 * groups * state_size
    tokens = sum(new_lens)
    # One projection row per token: z (unused here) | x B C | dt, as in_proj writes it.
    projection = rand(tokens, heads * head_dim + conv_dim + heads).to(dtype)
    start = heads * head_dim
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    return MambaBatch(
        xbc=projection[:, start : start + conv_dim],
        dt=projection[:, start + conv_dim :],
        conv_weight=rand(conv_dim, taps, scale=0.5).to(dtype),
        conv_bias=rand(conv_dim, scale=0.1).to(dtype),
        A=-torch.rand(heads, generator=generator).add(0.5).to(device),
        D=rand(heads),
        dt_bias=rand(heads, scale=0.5),
        conv_state=rand(num_slots, taps - 1, conv_dim).to(dtype),
        ssm_state=rand(num_slots, heads, head_dim, state_size),
        cu_seqlens=cu.to(device),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix_lens, new_lens, strict=True)],
                              dtype=torch.int32, device=device),
        state_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        heads=heads, head_dim=head_dim, groups=groups, state_size=state_size,
    )

"""The paged KV cache: one K and one V tensor per layer, carved from a single allocation."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        # Views made once: attention asks for its layer's on every call (~10 us to index).
        self._layers = [(self.storage[0, i], self.storage[1, i]) for i in range(num_layers)]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k_cache, v_cache)` of a layer, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        return self._layers[layer_id]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

"""Backend interface."""

from __future__ import annotations

from typing import Protocol

import torch

from kvpage.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's K/V into their slots, then attend each query over its sequence's blocks."""
        ...


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter each new token's K and V to ``slot = block * block_size + offset``."""
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[0, blocks, offsets] = key.to(kv_cache.dtype)  # works on any strides (the engine's are block-major)
    kv_cache[1, blocks, offsets] = value.to(kv_cache.dtype)

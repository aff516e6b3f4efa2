"""The backend seam.

A backend is two things. Its ``MetadataBuilder``, made once per cache layout, turns the runner's common
``AttentionMetadata`` into the backend's own metadata once per step: it splits the batch among its kernels
and plans their work, so the layers only consume. Its ``forward(q, k, v, kv_cache, meta, scale)`` writes a
layer's new K/V and attends, given that metadata. ``prefill_min`` tells the runner which prompt chunks the
backend wants grouped at the end of the batch (None: any order)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvpage.attention.kv_quant import is_quantized, write_rows
from kvpage.attention.metadata import AttentionMetadata


class MetadataBuilder(Protocol):
    # Chunks of at least this many query rows are placed after the others, those after cached keys first, then
    # whole fresh prompts (a backend's prompt kernels take them); None: the runner keeps the scheduler's order.
    prefill_min: int | None

    def build(self, common: AttentionMetadata) -> Any:
        """This step's metadata for every layer's ``forward``."""
        ...


class AttentionBackend(Protocol):
    name: str

    def metadata_builder(self, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int,
                         window: int | None = None) -> MetadataBuilder:
        """The builder of one KV group: caches shaped like ``kv_cache`` under activations of ``dtype``, queries
        of ``num_heads`` heads, the group's sliding ``window`` (None: full attention). The groups of a model
        share tensors, so a layout of the backend's own must follow from the tensors alone, window or not."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: Any,  # what this backend's builder built for the step
        scale: float,
        key_feedback: torch.Tensor | None = None,  # quantized row pages: the keys' rounding feedback (kv_quant)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's K/V into their slots, then attend each query over its sequence's blocks."""
        ...

    def transform_rows(self, x: torch.Tensor, sub: torch.Tensor | None, mul: torch.Tensor | None, rotate: bool,
                       add: torch.Tensor | None) -> torch.Tensor:
        """A quantized cache's key/value transform over ``[tokens, heads, D]`` rows (kv_transform.affine_rows)."""
        ...


class CommonMetadata:
    """The builder of a backend that consumes the runner's metadata as it is."""

    prefill_min: int | None = None

    def build(self, common: AttentionMetadata) -> AttentionMetadata:
        return common


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             key_feedback: torch.Tensor | None = None) -> None:
    """Scatter each new token's K and V to ``slot = block * block_size + offset`` (quantized caches: each row
    quantized with its scale, the keys with ``key_feedback`` if given, attention/kv_quant.py)."""
    if is_quantized(kv_cache.dtype):
        write_rows(key, value, kv_cache, slot_mapping, key_feedback)
        return
    if key_feedback is not None:
        raise ValueError(f"key rounding feedback is for quantized pages, not {kv_cache.dtype} ones")
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[0, blocks, offsets] = key.to(kv_cache.dtype)  # works on any strides (the engine's are block-major)
    kv_cache[1, blocks, offsets] = value.to(kv_cache.dtype)

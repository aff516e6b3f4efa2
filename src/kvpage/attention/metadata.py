"""Per-step description of a flat, unpadded batch: what the runner knows about it, the same for every backend
(vLLM's common attention metadata). Each backend's ``MetadataBuilder`` turns it, once per step, into what
that backend's layers consume (backends/base.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] of the flat batch.

    Its tokens sit at positions seq_lens[i] - query_len .. seq_lens[i] - 1: the earlier ones (a cached
    prefix, earlier prompt chunks, or everything before a decode token) are already in the paged cache.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 past each table's end
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64: tokens in the cache after this step's write
    block_size: int
    # Python copies of the small per-sequence arrays, so CPU backends do not convert tensors every layer.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # The KV group's sliding window (a query sees itself and window - 1 positions back), None for full
    # attention; block-table entries wholly before every query's window may be placeholders (never read).
    window: int | None = None
    # int8 pages with keys per channel: the residual-key group's slots and block tables (kv/residual.py), where
    # each new token's key is written unrounded and each sequence's filling block is read from; else None.
    residual_slot_mapping: torch.Tensor | None = None
    residual_block_tables: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

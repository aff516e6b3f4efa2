"""Per-step description of a flat, unpadded batch (shared by every layer and backend)."""

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
    # Split for backends that hand fresh prompts (no cached prefix) to a dense kernel: the first
    # ``paged_seqs`` sequences (rows [0, paged_rows)) go through the paged kernel; each (start, length) in
    # ``fresh_prefills`` is a whole prompt with nothing cached before it. The runner orders the batch so.
    paged_seqs: int = -1  # -1: every sequence is paged work
    paged_rows: int = -1
    fresh_prefills: tuple[tuple[int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

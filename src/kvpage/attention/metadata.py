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
    # Split for backends that hand long prompt work to a prompt kernel: the first ``paged_seqs`` sequences
    # (rows [0, paged_rows)) are decodes and short chunks for the paged kernel; then come ``cached_prefills``,
    # prompt chunks after cached keys (sequences paged_seqs .. paged_seqs + len - 1, each (start row, length)),
    # then ``fresh_prefills``, whole prompts with nothing cached before them (the sequences after those, each
    # (start row, length)). The runner orders the batch so.
    paged_seqs: int = -1  # -1: every sequence is paged work
    paged_rows: int = -1
    cached_prefills: tuple[tuple[int, int], ...] = ()
    fresh_prefills: tuple[tuple[int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

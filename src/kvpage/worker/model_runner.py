"""Turns one step's scheduled work into a flat, unpadded batch and runs the model on the paged cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.model.llama import LlamaForCausalLM
from kvpage.worker.kv_cache import KVCache


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute ``token_ids`` at positions start_pos, start_pos+1, ..."""

    seq_id: str
    token_ids: Sequence[int]
    start_pos: int  # tokens of this sequence already in the cache (cached prefix, earlier chunks)
    block_table: Sequence[int]
    need_logits: bool = True  # False for a prompt chunk that is not the last one
    all_logits: bool = False  # logits for every computed token (prompt logprobs, teacher forcing)


@dataclass
class BlockOps:
    """What the KV manager asked the worker to move before this step's forward pass."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # flat-batch rows whose logits are computed
    logits_slices: dict[str, slice]  # per sequence: its part of logits_rows


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size

    def prepare(self, batch: Sequence[ScheduledSeq]) -> PreparedBatch:
        if not batch:
            raise ValueError("empty batch")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        rows: list[int] = []
        slices: dict[str, slice] = {}
        max_blocks = 0
        for s in batch:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"{s.seq_id}: nothing to compute")
            end = s.start_pos + n
            if -(-end // bs) > len(s.block_table):
                raise ValueError(f"{s.seq_id}: block table of {len(s.block_table)} blocks cannot hold {end} tokens")
            ids.extend(s.token_ids)
            table = s.block_table
            for p in range(s.start_pos, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            max_blocks = max(max_blocks, -(-end // bs))
            if s.all_logits:
                slices[s.seq_id] = slice(len(rows), len(rows) + n)
                rows.extend(range(qsl[-2], qsl[-1]))
            elif s.need_logits:
                slices[s.seq_id] = slice(len(rows), len(rows) + 1)
                rows.append(qsl[-1] - 1)
        tables = torch.zeros((len(batch), max_blocks), dtype=torch.long)
        for i, s in enumerate(batch):
            n_blocks = -(-seq_lens[i] // bs)
            tables[i, :n_blocks] = torch.tensor(list(s.block_table[:n_blocks]), dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=tables,
            query_start_loc=torch.tensor(qsl, dtype=torch.long),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            block_size=bs,
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        return PreparedBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta,
                             torch.tensor(rows, dtype=torch.long), slices)

    def apply_block_ops(self, ops: BlockOps | None) -> None:
        """In the order the KV manager's plans require: swap out, swap in, copy-on-write."""
        if ops is None:
            return
        self.kv_cache.swap_out(ops.swap_out)
        self.kv_cache.swap_in(ops.swap_in)
        self.kv_cache.copy_blocks(ops.copies)

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledSeq], ops: BlockOps | None = None) -> dict[str, torch.Tensor]:
        """Run one step; float32 logits per sequence that asked: [vocab] for its last token, or
        [tokens, vocab] with ``all_logits``."""
        self.apply_block_ops(ops)
        prepared = self.prepare(batch)
        hidden = self.model(prepared.input_ids, prepared.positions, self.kv_cache.layers, prepared.meta)
        logits = self.model.compute_logits(hidden[prepared.logits_rows]).float()
        all_rows = {s.seq_id for s in batch if s.all_logits}
        return {sid: logits[sl] if sid in all_rows else logits[sl.start] for sid, sl in prepared.logits_slices.items()}

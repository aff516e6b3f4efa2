"""Turns one step's scheduled work into a flat, unpadded batch and runs the model on the paged cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.core.prompt_scores import PromptScore
from kvpage.distributed.kv_shards import BlockShards
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.logits import LogitsBuffer, RowDraws
from kvpage.worker.kv_cache import KVCache
from kvpage.worker.pass_draws import DrawSetting, row_draws_tensors


def _no_disk_tier(entry: Any, payload: bytes) -> None:
    raise RuntimeError("a block was sent to the disk tier but this engine has none (kv_offload_dir unset)")


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute ``token_ids`` at positions start_pos, start_pos+1, ..."""

    seq_id: str
    token_ids: Sequence[int]
    start_pos: int  # tokens of this sequence already in the cache (cached prefix, earlier chunks)
    block_table: Sequence[int]
    need_logits: bool = True  # False for a prompt chunk that is not the last one
    all_logits: bool = False  # logits for every computed token (teacher forcing: worker/scoring.py)
    # One table per KV group when the model has several (block_table is then the first); -1: dropped by a window
    block_tables: Sequence[Sequence[int]] | None = None
    # prompt logprobs: (first scored token of this chunk, counted from its start; the tokens those positions
    # predict; how many top logprobs each) -- core/prompt_scores.py says which positions
    scores: tuple[int, Sequence[int], int] | None = None

    def tables(self, num_groups: int) -> Sequence[Sequence[int]]:
        if self.block_tables is not None:
            if len(self.block_tables) != num_groups:
                raise ValueError(f"{self.seq_id}: {len(self.block_tables)} block tables for {num_groups} KV groups")
            return self.block_tables
        if num_groups != 1:
            raise ValueError(f"{self.seq_id}: one block table for a model of {num_groups} KV groups")
        return (self.block_table,)


@dataclass
class BlockOps:
    """What the KV manager asked the worker to move before this step's forward pass."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    persists: list[tuple[int, Any]] = field(default_factory=list)  # (device block, TierEntry): to the disk tier
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)  # (bytes from the disk tier, device block)


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    common: list[AttentionMetadata]  # the runner's description of the batch, per KV group
    meta: list[Any]  # what the attention backend's builder made of it, per layer (its group's)
    logits_rows: torch.Tensor  # flat-batch rows whose logits are computed
    logits_slices: dict[str, slice]  # per sequence: its part of logits_rows
    score_rows: list[tuple[ScheduledSeq, int]] = field(default_factory=list)  # (seq, flat row of its first score)


class StepLogits:
    """Per-sequence logits of one step (a read-only mapping), with each last row's argmax and log-sum-exp."""

    def __init__(self, logits, argmax, lse, slices: dict[str, slice], all_rows: set[str],
                 tokens: torch.Tensor | None = None, prompt_scores: dict[str, list[PromptScore]] | None = None,
                 ) -> None:
        self.logits, self.argmax_rows, self.lse_rows = logits, argmax, lse
        self.tokens = tokens  # [rows, draws] when the logits pass drew each row's tokens (no logits then)
        self.prompt_scores = prompt_scores or {}  # prompt logprobs, per scoring sequence
        self._slices, self._all = slices, all_rows

    def __getitem__(self, seq_id: str) -> torch.Tensor:
        if self.logits is None:
            raise KeyError(f"{seq_id}: this step computed only argmaxes (execute(..., argmax_only=True))")
        sl = self._slices[seq_id]
        return self.logits[sl] if seq_id in self._all else self.logits[sl.start]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._slices

    def __len__(self) -> int:
        return len(self._slices)

    def __iter__(self):
        return iter(self._slices)

    def keys(self):
        return self._slices.keys()

    def row(self, seq_id: str) -> int:
        """Row (in ``logits``) of the sequence's last token."""
        return self._slices[seq_id].stop - 1


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        # the fast path where the loader enabled it (model/fast_path.py), else the reference model
        self.forward = model.fast or model
        self.kv_cache = kv_cache
        # sizes the prompt-logprobs slices alike on every tensor-parallel rank
        self.vocab_size = int(model.config.vocab_size or model.embed_tokens.weight.shape[0])
        self.block_size = kv_cache.block_size
        self.persist: Callable[[Any, bytes], None] = _no_disk_tier
        # this rank's share of a disk-tier block (under tensor parallelism gathered out, sliced in; the worker
        # sets the rank and size)
        self.shards = BlockShards(0, 1, kv_cache.block_nbytes)
        layout = self.layout = kv_cache.layout
        attn = model.layers[0].self_attn
        # One builder per KV group: it splits and plans each step once for all the group's layers (the groups
        # share tensors, and every layout's loops take sliding windows).
        # (residual-key groups have no attention of their own: their tables ride with their partner's metadata)
        self.builders = [attn.backend.metadata_builder(kv_cache.tensors[0], model.embed_tokens.weight.dtype,
                                                       attn.num_heads, window=g.spec.window)
                         for g in layout.groups if not g.spec.residual]
        self.layer_group = [layout.group(i) for i in range(layout.num_layers)]
        # the batch order the prompt kernels want (the first group that has any)
        self.prefill_min = next((b.prefill_min for b in self.builders if b.prefill_min is not None), None)

    def prepare(self, batch: Sequence[ScheduledSeq]) -> PreparedBatch:
        if not batch:
            raise ValueError("empty batch")
        # Paged work first, then long prompt chunks after cached keys, then long fresh prompts: a backend with
        # prompt kernels takes the last two groups (its builder's prefill_min says from how many rows).
        minimum = self.prefill_min
        long = [] if minimum is None else [s for s in batch if len(s.token_ids) >= minimum]
        cached = [s for s in long if s.start_pos > 0]
        fresh = [s for s in long if s.start_pos == 0]
        if long:
            ids_long = {id(s) for s in long}
            batch = [s for s in batch if id(s) not in ids_long] + cached + fresh
        bs = self.block_size
        num_groups = len(self.layout.groups)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        qsl = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        rows: list[int] = []
        slices: dict[str, slice] = {}
        score_rows: list[tuple[ScheduledSeq, int]] = []
        max_blocks = 0
        tables_of = [s.tables(num_groups) for s in batch]
        for s, tables in zip(batch, tables_of, strict=True):
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"{s.seq_id}: nothing to compute")
            end = s.start_pos + n
            for table in tables:
                if -(-end // bs) > len(table):
                    raise ValueError(f"{s.seq_id}: block table of {len(table)} blocks cannot hold {end} tokens")
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, end))
            for g, table in enumerate(tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(s.start_pos, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            max_blocks = max(max_blocks, -(-end // bs))
            if s.scores is not None:
                score_rows.append((s, qsl[-2] + s.scores[0]))
            if s.all_logits:
                slices[s.seq_id] = slice(len(rows), len(rows) + n)
                rows.extend(range(qsl[-2], qsl[-1]))
            elif s.need_logits:
                slices[s.seq_id] = slice(len(rows), len(rows) + 1)
                rows.append(qsl[-1] - 1)
        qsl_t = torch.tensor(qsl, dtype=torch.long)
        lens_t = torch.tensor(seq_lens, dtype=torch.long)
        commons, metas = [], []

        def block_tables(g: int) -> torch.Tensor:
            # one tensor from padded rows (a tensor per sequence cost ~0.6 ms per 100-sequence step); entries a
            # sliding window dropped (-1) become block 0, which no kernel reads
            padded = []
            for tables, end in zip(tables_of, seq_lens, strict=True):
                row = [b if b >= 0 else 0 for b in tables[g][: -(-end // bs)]]
                padded.append(row + [0] * (max_blocks - len(row)))
            return torch.tensor(padded, dtype=torch.long).reshape(len(batch), max_blocks)

        for g, builder in enumerate(self.builders):
            r = self.layout.residual_of.get(g)
            common = AttentionMetadata(
                slot_mapping=torch.tensor(slots[g], dtype=torch.long),
                block_tables=block_tables(g),
                query_start_loc=qsl_t,
                seq_lens=lens_t,
                block_size=bs,
                query_lens_list=query_lens,
                seq_lens_list=seq_lens,
                window=self.layout.groups[g].spec.window,
                residual_slot_mapping=None if r is None else torch.tensor(slots[r], dtype=torch.long),
                residual_block_tables=None if r is None else block_tables(r),
            )
            commons.append(common)
            metas.append(builder.build(common))
        layer_metas = [metas[g] for g in self.layer_group]
        return PreparedBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), commons,
                             layer_metas, torch.tensor(rows, dtype=torch.long), slices, score_rows)

    def apply_block_ops(self, ops: BlockOps | None) -> None:
        """In the order the KV manager's plans require: device -> host (swap-outs, prefix offloads), device ->
        disk (the bytes are taken now, written by the disk tier's thread), host -> device (swap-ins, prefix
        loads), disk -> device, copy-on-write: every read of a block comes before any write into it."""
        if ops is None:
            return
        self.kv_cache.swap_out(ops.swap_out)
        if ops.persists:
            # every rank's share, joined on rank 0; None on a follower: rank 0 writes the files
            payloads = self.shards.gather(self.kv_cache.read_blocks([block for block, _ in ops.persists]))
            if payloads is not None:
                for (_, entry), payload in zip(ops.persists, payloads, strict=True):
                    self.persist(entry, payload)
        self.kv_cache.swap_in(ops.swap_in)
        self.kv_cache.write_blocks([(self.shards.mine(payload), block) for payload, block in ops.disk_loads])
        self.kv_cache.copy_blocks(ops.copies)

    @torch.inference_mode()
    def forward_only(self, batch: Sequence[ScheduledSeq], ops: BlockOps | None = None) -> list[torch.Tensor]:
        """A tensor-parallel follower's step: block operations and the forward pass into its KV shard. Returns
        the hidden states rank 0 computes logits for, in the order it runs the lm head on them (the prompt
        logprobs' slices, then the step's rows); every rank ends the pass with the same hidden states."""
        self.apply_block_ops(ops)
        prepared = self.prepare(batch)
        hidden = self.forward(prepared.input_ids, prepared.positions, self.kv_cache.layers, prepared.meta)
        slices = [hidden[rows] for _, rows, _ in score_slices(prepared, self.vocab_size)]
        return [*slices, hidden[prepared.logits_rows]]

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledSeq], ops: BlockOps | None = None,
                argmax_only: bool = False, logits_buffer: LogitsBuffer | None = None,
                draws: dict[str, DrawSetting] | None = None) -> StepLogits:
        """Run one step; float32 logits per sequence that asked: [vocab] for its last token, or
        [tokens, vocab] with ``all_logits``. ``argmax_only`` (every sample of the step is plain greedy, no
        logprobs): only each row's argmax, which saves writing and scanning [rows, vocab] float32 logits.
        With ``logits_buffer`` the logits live in it, valid until the next step that uses it (steps with
        all-token logits get their own tensor). With ``draws`` for every sequence that asked (none wanting all
        its logits), the logits pass may draw the tokens itself: the result then has ``tokens`` and no logits;
        a head that cannot returns the logits as usual."""
        self.apply_block_ops(ops)
        prepared = self.prepare(batch)
        hidden = self.forward(prepared.input_ids, prepared.positions, self.kv_cache.layers, prepared.meta)
        scores = self._prompt_scores(hidden, prepared)  # first: the head's calls in the followers' order
        all_rows = {s.seq_id for s in batch if s.all_logits}
        row_draws = None
        if draws is not None and not all_rows and not argmax_only and draws.keys() == prepared.logits_slices.keys():
            by_row = sorted((sl.stop - 1, draws[s]) for s, sl in prepared.logits_slices.items())
            row_draws = RowDraws(**row_draws_tensors([d for _, d in by_row]))
        res = self.forward.compute_logits_ex(hidden[prepared.logits_rows], argmax_only and not all_rows,
                                             None if all_rows else logits_buffer, draws=row_draws)
        return StepLogits(res.logits, res.argmax, res.lse, prepared.logits_slices, all_rows, res.tokens, scores)

    def _prompt_scores(self, hidden: torch.Tensor, prepared: PreparedBatch) -> dict[str, list[PromptScore]]:
        """Each scoring sequence's prompt logprobs, from float32 logits of at most ~64 MB at a time (a 2,048-token
        chunk's [rows, vocab] would be 400 MB for SmolLM2, 2 GB for Gemma 3)."""
        scores: dict[str, list[PromptScore]] = {}
        for seq, rows, targets in score_slices(prepared, self.vocab_size):
            res = self.forward.compute_logits_ex(hidden[rows])
            logits = res.logits
            lse = res.lse if res.lse is not None else torch.logsumexp(logits, dim=-1)
            tgt = torch.tensor(targets, dtype=torch.long)
            chosen = logits.gather(1, tgt[:, None])[:, 0]
            ranks = (logits > chosen[:, None]).sum(dim=1) + 1
            lps = (chosen - lse).tolist()
            k = seq.scores[2]
            top_ids = top_lps = None
            if k > 0:
                vals, idx = logits.topk(k, dim=1)
                top_ids, top_lps = idx.tolist(), (vals - lse[:, None]).tolist()
            out = scores.setdefault(seq.seq_id, [])
            for i, (lp, rank) in enumerate(zip(lps, ranks.tolist(), strict=True)):
                top = () if top_ids is None else tuple(zip(top_ids[i], top_lps[i], strict=True))
                out.append(PromptScore(lp, rank, top))
        return scores


# float32 logits of one prompt-logprobs slice: at most this many bytes (at least one row)
SCORE_SLICE_BYTES = 64 << 20


def score_slices(prepared: PreparedBatch, vocab: int) -> list[tuple[ScheduledSeq, torch.Tensor, list[int]]]:
    """(sequence, flat-batch rows, the tokens they predict) per slice of the step's prompt-logprobs rows, in the
    order the lm head runs on them (rank 0 and the tensor-parallel followers must agree on it)."""
    per = max(1, SCORE_SLICE_BYTES // (4 * vocab))
    out = []
    for seq, row in prepared.score_rows:
        targets = list(seq.scores[1])
        for i in range(0, len(targets), per):
            part = targets[i : i + per]
            out.append((seq, torch.arange(row + i, row + i + len(part)), part))
    return out

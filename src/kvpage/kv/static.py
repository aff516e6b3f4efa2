"""The static-reservation KV manager: the contiguous per-request baseline paging is measured against."""

from __future__ import annotations

import bisect
import math

from kvpage.kv.block import DEFAULT_BLOCK_SIZE, KVBlock
from kvpage.kv.paged import KVCacheManager, _SeqState, _sid
from kvpage.kv.prefix_hash import BlockHash, HashFn, sha256_digest
from kvpage.kv.protocol import NOTHING, Allocation, PrefixHit
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.slot_mapping import cdiv
from kvpage.kv.specs import KVLayout

RESERVE_POLICIES = ("max", "pow2", "oracle")


class StaticReservationManager(KVCacheManager):
    """The baseline paging is measured against: each request gets one contiguous run of blocks at
    admission, sized up front, as contiguous per-request allocators do. No prefix sharing; forks copy.

    ``reserve`` picks the size, after the vLLM paper's Orca variants: ``max`` reserves max_model_len,
    ``pow2`` the next power of two >= prompt + max_tokens, ``oracle`` exactly prompt + max_tokens (as if
    the output length were known). Runs are placed first-fit by block id, so variable sizes leave holes
    between reservations: external fragmentation, which ``stranded_free_blocks`` measures.

    With a ``layout`` of several KV groups, a reservation is one run holding every group's blocks, group after
    group, each for the whole reserved length: a contiguous allocator knows no window, so sliding-window layers
    keep every position too (their kernels read only the window). That is the baseline groups are measured
    against.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, *, max_model_len: int,
                 reserve: str = "max", watermark: float = 0.01, num_swap_blocks: int = 0, model_id: str = "",
                 hash_fn: HashFn = sha256_digest, layout: KVLayout | None = None) -> None:
        super().__init__(num_blocks, block_size, watermark=watermark, enable_prefix_caching=False,
                         num_swap_blocks=num_swap_blocks, max_model_len=max_model_len, model_id=model_id,
                         hash_fn=hash_fn)
        if reserve not in RESERVE_POLICIES:
            raise ValueError(f"unknown reservation policy {reserve!r}: choose one of {', '.join(RESERVE_POLICIES)}")
        self.reserve = reserve
        self.layout = layout
        self.num_groups = len(layout.groups) if layout is not None else 1
        self.reserved_blocks = math.ceil(max_model_len / block_size) * self.num_groups  # the largest reservation
        if self.reserved_blocks > num_blocks:
            raise ValueError(
                f"one reservation of max_model_len={max_model_len} needs {self.reserved_blocks} blocks "
                f"but the pool has {num_blocks}"
            )
        self._extents: list[list[int]] = [[0, num_blocks]]  # free runs [start, length], sorted by start

    # ------------------------------------------------------------ sizing
    def reservation_blocks(self, seq: SequenceLike) -> int:
        """Blocks reserved for ``seq`` at admission (never fewer than its tokens already need)."""
        limit = self.max_model_len or 0
        total = seq.max_total_tokens
        if self.reserve == "max" or total is None:
            tokens = limit
        elif self.reserve == "oracle":
            tokens = min(limit, total)
        else:
            tokens = min(limit, 1 << max(0, total - 1).bit_length())
        return max(cdiv(tokens, self.block_size), cdiv(len(seq.token_ids), self.block_size), 1) * self.num_groups

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens occupy over every group (validated against max_model_len)."""
        return super().blocks_needed(num_tokens) * self.num_groups

    def _group_len(self, state: _SeqState) -> int:
        return len(state.table) // self.num_groups

    def block_table(self, seq_id: str) -> list[int]:
        """The first group's blocks (every group's: ``block_tables``)."""
        return self.block_tables(seq_id)[0]

    def block_tables(self, seq_id: str) -> list[list[int]]:
        """One block table per KV group: consecutive slices of the sequence's reservation."""
        state = self._state(seq_id)
        n = self._group_len(state)
        ids = [b.block_id for b in state.table]
        return [ids[g * n : (g + 1) * n] for g in range(self.num_groups)]

    def growth_blocks(self, seq_id: str, num_tokens: int, held_tokens: int = 0) -> int:
        """None: a reservation holds, from admission on, all its sequence may ever take."""
        return 0

    def _admission_reserve(self) -> int:
        """No reserve: the watermark protects running sequences' growth, and a reservation already holds
        everything its sequence will ever need, so keeping blocks back would only cost the baseline a slot
        (a pool of 16 reservations would admit 15)."""
        return 0

    def stranded_free_blocks(self, need_blocks: int) -> int:
        """Free blocks in runs too short for a reservation of ``need_blocks``."""
        return sum(n for _, n in self._extents if n < need_blocks)

    @property
    def largest_free_run(self) -> int:
        return max((n for _, n in self._extents), default=0)

    # ------------------------------------------------------- placement
    def _take_run(self, n: int) -> list[KVBlock] | None:
        """First fit: the lowest-addressed free run of ``n`` blocks, or None."""
        for i, (start, length) in enumerate(self._extents):
            if length >= n:
                if length == n:
                    del self._extents[i]
                else:
                    self._extents[i] = [start + n, length - n]
                blocks = self.pool.blocks[start : start + n]
                self.pool.touch(blocks)
                return blocks
        return None

    def _give_back(self, table: list[KVBlock]) -> None:
        """Return a run to the extent list, merging it with free neighbours."""
        start, n = table[0].block_id, len(table)
        ext = self._extents
        i = bisect.bisect_left(ext, [start, 0])
        if i < len(ext) and start + n == ext[i][0]:
            n += ext[i][1]
            del ext[i]
        if i > 0 and ext[i - 1][0] + ext[i - 1][1] == start:
            ext[i - 1][1] += n
        else:
            ext.insert(i, [start, n])

    def _place(self, sid: str, n_blocks: int, num_tokens: int, root: BlockHash) -> list[KVBlock] | None:
        if self.pool.num_free_blocks - n_blocks < self._admission_reserve():
            return None
        table = self._take_run(n_blocks)
        if table is not None:
            self._seqs[sid] = _SeqState(table, num_tokens, [], root)
        return table

    # ------------------------------------------------------- allocation
    def _admit(self, seq: SequenceLike, num_new_tokens: int, hit: PrefixHit) -> Allocation | None:
        if seq.seq_id in self._swapped:
            raise RuntimeError(f"sequence {seq.seq_id!r} is swapped out: swap_in before allocating")
        self.blocks_needed(num_new_tokens)  # validates against max_model_len
        table = self._place(seq.seq_id, self.reservation_blocks(seq), num_new_tokens, self._root(seq))
        if table is None:
            return None
        return Allocation(tuple(b.block_id for b in table))

    def allocate_slots(
        self, seq: SequenceLike, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> Allocation | None:
        state = self._seqs.get(seq.seq_id)
        if state is not None and num_new_tokens > 0:
            total = state.num_tokens + num_new_tokens
            self.blocks_needed(total)  # validates against max_model_len
            if total > self._group_len(state) * self.block_size:
                raise RuntimeError(
                    f"sequence {seq.seq_id!r} outgrew its {self.reserve!r} reservation of "
                    f"{self._group_len(state) * self.block_size} tokens (max_tokens was too small a promise)"
                )
            state.num_tokens = total
            return NOTHING
        return super().allocate_slots(seq, num_new_tokens, prefix_hit)

    def free(self, seq: SequenceLike | str) -> None:
        state = self._seqs.get(_sid(seq))
        super().free(seq)
        if state is not None:
            self._give_back(state.table)

    def fork(self, parent: SequenceLike | str, child: SequenceLike | str) -> Allocation | None:
        """No sharing: the child gets its own reservation and a copy of every filled block."""
        pstate, cid = self._fork_ids(parent, child)
        new = self._place(cid, len(pstate.table), pstate.num_tokens, pstate.root)
        if new is None:
            return None
        filled, n = cdiv(pstate.num_tokens, self.block_size), self._group_len(pstate)
        copies = tuple((pstate.table[g * n + i].block_id, new[g * n + i].block_id)
                       for g in range(self.num_groups) for i in range(filled))
        return Allocation(tuple(b.block_id for b in new), copies)

    def swap_out(self, seq: SequenceLike | str) -> list[tuple[int, int]] | None:
        state = self._seqs.get(_sid(seq))
        mapping = super().swap_out(seq)
        if mapping is not None and state is not None:
            self._give_back(state.table)
        return mapping

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None:
        sid = seq.seq_id
        swapped = self._swapped_state(sid)
        host = swapped.host_blocks
        table = self._place(sid, len(host), swapped.num_tokens, swapped.root)
        if table is None:
            return None
        del self._swapped[sid]
        self._host_free.extend(reversed(host))
        self.counters.blocks_swapped_in += len(host)
        return [(h, b.block_id) for h, b in zip(host, table, strict=True)]

    # ------------------------------------------------------- stats and invariants
    def fills(self) -> tuple[dict[int, int], int]:
        """Tokens stored in each reserved block, group by group (every group holds every token)."""
        bs = self.block_size
        fill: dict[int, int] = {}
        logical = 0
        for state in self._seqs.values():
            n = self._group_len(state)
            for i, block in enumerate(state.table):
                f = min(bs, max(0, state.num_tokens - (i % n) * bs))
                logical += f
                fill[block.block_id] = f
        return fill, logical

    def _max_waste_ok(self, waste: int) -> bool:
        return waste >= 0

    def _table_len_ok(self, table_len: int, num_tokens: int) -> bool:
        return (table_len % self.num_groups == 0
                and cdiv(num_tokens, self.block_size) * self.num_groups <= table_len <= self.reserved_blocks)

    def check_invariants(self) -> None:
        super().check_invariants()
        free_ids = sorted(b.block_id for b in self.pool.free_blocks())
        runs = [i for start, n in self._extents for i in range(start, start + n)]
        assert runs == free_ids, "the free runs disagree with the free queue"
        for a, b in zip(self._extents, self._extents[1:], strict=False):
            assert a[0] + a[1] < b[0], f"free runs {a} and {b} overlap or should have merged"
        for sid, state in self._seqs.items():
            ids = [b.block_id for b in state.table]
            assert ids == list(range(ids[0], ids[0] + len(ids))), f"{sid}: reservation is not contiguous"

"""A paged manager's sequences: the state it keeps per sequence, swapping them to the host tier and back, what
their blocks hold (fills, stats) and what they will still take (growth).

Split from paged.py; ``PagedSeqs`` is a base of ``KVCacheManager`` and reads its pool, host tier and tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpage.kv.block import KVBlock
from kvpage.kv.prefix_hash import BlockHash
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.slot_mapping import cdiv
from kvpage.kv.stats import KVStats, make_stats

if TYPE_CHECKING:
    from kvpage.kv.block_pool import BlockPool
    from kvpage.kv.host_tier import HostTier
    from kvpage.kv.stats import KVCounters


def _sid(seq: SequenceLike | str) -> str:
    return seq if isinstance(seq, str) else seq.seq_id


class _SeqState:
    __slots__ = ("hashes", "num_tokens", "root", "table")

    def __init__(self, table: list[KVBlock], num_tokens: int, hashes: list[BlockHash], root: BlockHash) -> None:
        self.table = table
        self.num_tokens = num_tokens  # tokens that have a slot
        self.hashes = hashes  # chained hashes of the leading full blocks
        self.root = root


@dataclass
class _SwappedState:
    host_blocks: list[int]
    num_tokens: int
    hashes: list[BlockHash]
    root: BlockHash


class PagedSeqs:
    """swap_out / swap_in, growth, fills and stats of ``KVCacheManager`` (the attributes below are the
    manager's)."""

    pool: BlockPool
    block_size: int
    counters: KVCounters
    _host_free: HostTier
    _seqs: dict[str, _SeqState]
    _swapped: dict[str, _SwappedState]

    def growth_blocks(self, seq_id: str, num_tokens: int, held_tokens: int = 0) -> int:
        """Blocks the pool must still give ``seq_id`` for it to hold ``num_tokens`` tokens between steps: from
        the slots it has, or from ``held_tokens`` (a prefix hit's) for a sequence not admitted yet."""
        state = self._seqs.get(seq_id)
        start = state.num_tokens if state is not None else held_tokens
        return max(0, self._held_blocks(num_tokens) - self._held_blocks(start))

    def _held_blocks(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds between steps (a sliding window: its window's)."""
        return cdiv(num_tokens, self.block_size)

    def swap_out(self, seq: SequenceLike | str) -> list[tuple[int, int]] | None:
        """Move a running sequence to the host pool: (device, host) copies, or None if it is full."""
        sid = _sid(seq)
        state = self._state(sid)
        n = len(state.table)
        if n > len(self._host_free):
            return None
        host = [self._host_free.pop() for _ in range(n)]
        mapping = [(b.block_id, h) for b, h in zip(state.table, host, strict=True)]
        del self._seqs[sid]
        self._release_table(sid, state)  # shared blocks stay with their other owners
        self._swapped[sid] = _SwappedState(host, state.num_tokens, state.hashes, state.root)
        self.counters.blocks_swapped_out += n
        return mapping

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back: (host, device) copies, or None if the device lacks room."""
        sid = seq.seq_id
        swapped = self._swapped_state(sid)
        host = swapped.host_blocks
        # Full blocks whose cached copy is still on the device need no transfer: share them instead.
        # Only a run from the first block can be verified (each block names its exact parent).
        resident: dict[int, KVBlock] = {}
        ident, bs, tokens = self._root_key(seq), self.block_size, seq.token_ids
        for i, h in enumerate(swapped.hashes):
            block = self.pool.lookup(h, ident, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            resident[i] = block
            ident = block.identity
        n_copy = len(host) - len(resident)
        revived = sum(1 for b in resident.values() if b.ref_count == 0)
        if self.pool.num_free_blocks - n_copy - revived < self._admission_reserve():
            return None
        self.pool.touch(resident.values())
        fresh = iter(self.pool.get_new_blocks(n_copy))
        table = [resident[i] if i in resident else next(fresh) for i in range(len(host))]
        del self._swapped[sid]
        self._host_free.release_after_read(reversed(host))
        mapping = [(h, b.block_id) for i, (h, b) in enumerate(zip(host, table, strict=True)) if i not in resident]
        self._seqs[sid] = _SeqState(table, swapped.num_tokens, [], swapped.root)
        # Copied full blocks become findable again (their K/V arrives before any read of this step).
        self.cache_computed_blocks(seq, len(swapped.hashes) * self.block_size)
        self.counters.blocks_swapped_in += n_copy
        return mapping

    # ------------------------------------------------------------------- stats
    def fills(self) -> tuple[dict[int, int], int]:
        """Tokens stored in each held block (a shared block counts its fullest holder), and the tokens the held
        blocks would store unshared (each sequence's, up to its blocks)."""
        bs = self.block_size
        fill: dict[int, int] = {}
        logical = 0
        for state in self._seqs.values():
            for i, block in enumerate(state.table):
                if block is None:
                    continue
                f = min(bs, max(0, state.num_tokens - i * bs))
                logical += f
                if f > fill.get(block.block_id, -1):
                    fill[block.block_id] = f
        return fill, logical

    def stats(self) -> KVStats:
        fill, logical = self.fills()
        return make_stats(self, fill, logical, len(self._seqs), len(self._swapped), self.counters)

"""The residual-key group: the unrounded keys of each sequence's filling block, beside an int8 page group.

int8 pages whose keys are rounded per channel (attention/kv_channel.py) round a block once, when its last key
arrives; until then its keys must be kept as they came, or every arrival that widens a channel's range would
round the earlier keys again (~0.45 points of top-1 agreement on Gemma 3). KIVI keeps such a residual beside
its cache; here it is a KV group of its own over the same layers, drawing from the same pool: a sequence holds
the block its next position lands in and nothing else (what a sliding window of one position holds), so forks
copy it on write, swaps move it, recompute rebuilds it and the scheduler's one budget counts it.

Nothing here is ever a prefix-cache entry: a hit stops at a block boundary, where the residual is empty, so
this group serves any hit the others can and registers no block.
"""

from __future__ import annotations

from kvpage.kv.block import DEFAULT_BLOCK_SIZE
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.sliding import SlidingWindowKVManager


class ResidualKVManager(SlidingWindowKVManager):
    """A sliding-window manager of one position whose blocks never enter the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, **kw) -> None:
        super().__init__(num_blocks, block_size, window=1, **kw)

    def cache_computed_blocks(self, seq: SequenceLike, num_computed_tokens: int | None = None) -> int:
        """Release the blocks that are complete (their keys now live rounded in the int8 pages)."""
        state = self._state(seq.seq_id)
        n = state.num_tokens if num_computed_tokens is None else min(num_computed_tokens, state.num_tokens)
        self._drop_passed(seq.seq_id, n)
        return 0

    def _drop_passed(self, sid: str, next_pos: int) -> int:
        """As a window's, and when the last block goes too (a block boundary: the sequence holds none), the
        blocks set aside behind it go back to the free queue."""
        last = self._last_block(self._seqs[sid].table)
        gone = super()._drop_passed(sid, next_pos)
        if gone and last is not None and self._last_block(self._seqs[sid].table) is None:
            self.pool.release_ahead(self._owner(sid), last)
        return gone


__all__ = ["ResidualKVManager"]

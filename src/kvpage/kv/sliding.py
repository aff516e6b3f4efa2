"""A sliding-window KV group: blocks leave as the window passes them.

A query at position p sees keys p - W + 1 .. p. After a step has computed a sequence's first n tokens, the
next query sits at position n or later, so a block whose last position is before n - W + 1 is never read
again: it is released at once (``cache_computed_blocks``, which the scheduler calls after every step) and its
table entry becomes None. Between steps a sequence thus holds at most ceil((W - 1) / block_size) + 1 blocks
here. A released full block keeps its prefix hash in the free queue, so a later request with the same prefix
can still revive it; a prefix hit needs only the blocks the window at the hit point covers.

Within the pool these blocks are chained by hash rather than by block identity (their predecessors may be
gone): a block is found by its chained hash, its own token ids and its parent's hash.
"""

from __future__ import annotations

from kvpage.kv.block import DEFAULT_BLOCK_SIZE, KVBlock
from kvpage.kv.offload import TierHit
from kvpage.kv.paged import KVCacheManager, _SeqState, _SwappedState
from kvpage.kv.prefix_hash import BlockHash, block_hash
from kvpage.kv.protocol import NO_HIT, PrefixHit
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.slot_mapping import cdiv


class SlidingWindowKVManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, *, window: int, **kw) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive number of positions, got {window!r}")
        super().__init__(num_blocks, block_size, **kw)
        self.window = window

    # ------------------------------------------------------------- the window
    def first_needed_block(self, next_pos: int) -> int:
        """The first block the query at ``next_pos`` (and every later one) still reads."""
        return max(0, next_pos - self.window + 1) // self.block_size

    def max_held_blocks(self) -> int:
        """Blocks a sequence holds at most between steps: ceil((W - 1) / block_size) + 1."""
        return cdiv(self.window - 1, self.block_size) + 1

    def _held_blocks(self, num_tokens: int) -> int:
        return min(super()._held_blocks(num_tokens), self.max_held_blocks())

    def _drop_passed(self, sid: str, next_pos: int) -> int:
        """Release the blocks no query from ``next_pos`` on reads (oldest first into the free queue, so the
        prefix cache evicts them first); returns how many."""
        state = self._seqs[sid]
        table = state.table
        gone = [i for i in range(min(self.first_needed_block(next_pos), len(table))) if table[i] is not None]
        if not gone:
            return 0
        blocks = [table[i] for i in gone]
        for i in gone:
            table[i] = None
        self.pool.release(blocks)
        return len(gone)

    # ------------------------------------------------------------ prefix cache
    def _parent(self, seq: SequenceLike, hashes: list[BlockHash], i: int) -> tuple:
        return ("sw", hashes[i - 1]) if i else self._root_key(seq)

    def lookup_prefix(self, seq: SequenceLike, max_tokens: int | None = None) -> PrefixHit:
        """The longest hit (at most ``max_tokens``, leaving >= 1 token to compute) whose window is cached: the
        blocks from the one holding position L - W + 1 to L - 1 for a hit of L tokens. Pure."""
        if not self.enable_prefix_caching:
            return NO_HIT
        tokens, bs = seq.token_ids, self.block_size
        limit = (len(tokens) - 1) // bs
        if max_tokens is not None:
            limit = min(limit, max_tokens // bs)
        hashes: list[BlockHash] = []
        found: list[KVBlock | TierHit | None] = []  # pool blocks, else blocks in the tiers below it
        parent = self._root(seq)
        for i in range(limit):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk, self.hash_fn)
            hashes.append(h)
            block = self.pool.lookup(h, self._parent(seq, hashes, i), chunk)
            if block is None and self.tiers is not None:
                block = self.tiers.find(h, parent, chunk, i)
            found.append(block)
            parent = h
        while True:
            k = self._longest_window(found, limit)
            if not k:
                return NO_HIT
            first = self.first_needed_block(k * bs)
            failed = False
            for i in range(first, k):  # a disk block whose bytes fail their check is a miss: choose again
                f = found[i]
                if isinstance(f, TierHit):
                    found[i] = staged = self.tiers.stage(f)
                    failed = failed or staged is None
            if not failed:
                break
        blocks = tuple(f if i >= first and isinstance(f, KVBlock) else None for i, f in enumerate(found[:k]))
        loads = tuple(f for f in found[first:k] if isinstance(f, TierHit))
        return PrefixHit(blocks, tuple(hashes[:k]), k * bs, loads=loads)

    def _longest_window(self, found: list, limit: int) -> int:
        """The most blocks k whose window (the blocks the query at k * block_size reads) is all found."""
        run = 0  # found blocks ending at block k - 1
        runs = []
        for b in found:
            run = run + 1 if b is not None else 0
            runs.append(run)
        for k in range(limit, 0, -1):
            if runs[k - 1] >= k - self.first_needed_block(k * self.block_size):
                return k
        return 0

    def _register_loads(self, seq: SequenceLike, table: list, hashes: list[BlockHash], loads: tuple) -> None:
        """Loaded window blocks enter the pool's cache, chained by hash (``hashes`` already holds the hit's)."""
        for load in loads:
            e = load.entry
            self.pool.cache_block(table[load.index], e.block_hash, self._parent(seq, hashes, load.index),
                                  e.token_ids, e.parent_hash)

    def cache_computed_blocks(self, seq: SequenceLike, num_computed_tokens: int | None = None) -> int:
        """Register newly full blocks (chained by hash), then release the blocks the window has passed."""
        state = self._state(seq.seq_id)
        n = state.num_tokens if num_computed_tokens is None else min(num_computed_tokens, state.num_tokens)
        registered = 0
        if self.enable_prefix_caching:
            tokens, bs = seq.token_ids, self.block_size
            full = min(n, len(tokens)) // bs
            hashes = state.hashes
            parent = hashes[-1] if hashes else state.root
            for i in range(len(hashes), full):
                chunk = tuple(tokens[i * bs : (i + 1) * bs])
                h = block_hash(parent, chunk, self.hash_fn)
                hashes.append(h)
                if state.table[i] is not None:
                    self.pool.cache_block(state.table[i], h, self._parent(seq, hashes, i), chunk, parent)
                    registered += 1
                parent = h
        self._drop_passed(seq.seq_id, n)
        return registered

    # -------------------------------------------------------------------- swap
    def swap_out(self, seq: SequenceLike | str) -> list[tuple[int, int]] | None:
        """Only the blocks the window still holds move to the host."""
        sid = seq if isinstance(seq, str) else seq.seq_id
        state = self._state(sid)
        held = [i for i, b in enumerate(state.table) if b is not None]
        if len(held) > len(self._host_free):
            return None
        host: list[int | None] = [None] * len(state.table)
        for i in held:
            host[i] = self._host_free.pop()
        mapping = [(state.table[i].block_id, host[i]) for i in held]
        del self._seqs[sid]
        self._release_table(sid, state)
        self._swapped[sid] = _SwappedState(host, state.num_tokens, state.hashes, state.root)  # type: ignore[arg-type]
        self.counters.blocks_swapped_out += len(held)
        return mapping

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None:
        sid = seq.seq_id
        swapped = self._swapped_state(sid)
        held = [i for i, h in enumerate(swapped.host_blocks) if h is not None]
        if self.pool.num_free_blocks - len(held) < self._admission_reserve():
            return None
        fresh = iter(self.pool.get_new_blocks(len(held)))
        table: list[KVBlock | None] = [next(fresh) if h is not None else None for h in swapped.host_blocks]
        del self._swapped[sid]
        mapping = [(swapped.host_blocks[i], table[i].block_id) for i in held]  # type: ignore[union-attr]
        self._host_free.release_after_read(reversed([h for h in swapped.host_blocks if h is not None]))
        self._seqs[sid] = _SeqState(table, swapped.num_tokens, [], swapped.root)
        # copied full blocks become findable again (their K/V arrives before any read of this step)
        self.cache_computed_blocks(seq, len(swapped.hashes) * self.block_size)
        self.counters.blocks_swapped_in += len(held)
        return mapping

    def free(self, seq: SequenceLike | str) -> None:
        sid = seq if isinstance(seq, str) else seq.seq_id
        swapped = self._swapped.pop(sid, None)
        if swapped is not None:
            self._host_free.extend(reversed([h for h in swapped.host_blocks if h is not None]))
            return
        super().free(sid)

    # ------------------------------------------------------------------- stats
    def _table_len_ok(self, table_len: int, num_tokens: int) -> bool:
        return table_len == cdiv(num_tokens, self.block_size)

    def reservation_blocks(self, seq: SequenceLike) -> int:
        return min(cdiv(len(seq.token_ids), self.block_size), self.max_held_blocks())

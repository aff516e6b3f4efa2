"""The device block pool: ref counts, the free/eviction queue and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvpage.kv.block import FreeBlockQueue, KVBlock
from kvpage.kv.prefix_hash import BlockHash

# Free blocks set aside behind a growing sequence's last block, so that its next blocks are consecutive.
AHEAD_BLOCKS = 8


class PoolListener(Protocol):
    """Told of the prefix cache's changes: a block became findable, is about to lose its hash because the pool
    hands it out again (its bytes are still intact until this step's block operations run), or every hash went."""

    def block_stored(self, block: KVBlock) -> None: ...

    def block_evicted(self, block: KVBlock) -> None: ...

    def cleared(self) -> None: ...


class BlockPool:
    """``num_blocks`` interchangeable blocks.

    Every block is either in use (ref_count >= 1, in one or more block tables) or free (ref_count 0,
    in the free queue or in the ahead queue). A free block may still hold a cached hash; it keeps its KV
    data until the pool hands it out again, at which point the hash is evicted.

    The ahead queue holds free, uncached blocks lying just after a growing sequence's last block
    (``KVBlock.ahead_of`` names it): that sequence takes them first, everyone else only when the free
    queue holds nothing but cached blocks (so setting aside never causes an eviction). They stay free in
    every count (admission, utilization, stats), so setting them aside never refuses an allocation; it only
    keeps a sequence's blocks consecutive, which the attention kernels read as one stream.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.ahead_queue = FreeBlockQueue([])
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.listeners: list[PoolListener] = []  # the offload tiers, the KV event stream

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.ahead_queue.num_free

    def free_blocks(self) -> list[KVBlock]:
        """Every free block (both queues)."""
        return [*self.free_queue, *self.ahead_queue]

    def get_new_blocks(self, n: int, after: KVBlock | None = None, owner: str | None = None) -> list[KVBlock]:
        """Take ``n`` blocks, evicting any cached hash they still carry.

        Each block is the one physically following the previous (``after`` for the first) when that one is
        free, uncached and not set aside for another sequence; otherwise the front of the LRU queue, unless
        that would evict a cached block while blocks set aside remain (then the ahead queue's front). With
        ``owner``, up to AHEAD_BLOCKS free uncached blocks after the last one taken are then set aside for that
        sequence's next allocations. Taking an uncached block out of order costs the prefix cache nothing: all
        of them sit at the queue's front anyway.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks: only {self.num_free_blocks} free")
        out = []
        prev = after
        for _ in range(n):
            block = self._free_successor(prev, owner)
            if block is None:
                if owner is not None:
                    self.release_ahead(owner, prev)  # the run is broken: what lay ahead of prev is no use now
                # Blocks set aside go before any cached block is evicted for them.
                front = self.free_queue.first()
                plain = front is not None and (front.block_hash is None or not self.ahead_queue.num_free)
                block = self._unqueue((self.free_queue if plain else self.ahead_queue).first())
            prev = block
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    for listener in self.listeners:
                        listener.block_evicted(block)
                block.clear_hash()
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        if owner is not None and prev is not None:
            self._set_aside(prev, owner)
        return out

    def _free_successor(self, prev: KVBlock | None, owner: str | None) -> KVBlock | None:
        """The block after ``prev``, taken out of its queue, if it is free, uncached and not someone else's."""
        if prev is None or prev.block_id + 1 >= self.num_blocks:
            return None
        block = self.blocks[prev.block_id + 1]
        if block.ref_count != 0 or block.block_hash is not None or block.ahead_of not in (None, owner):
            return None
        return self._unqueue(block)

    def _unqueue(self, block: KVBlock) -> KVBlock:
        """Take a free block out of whichever queue holds it (no longer set aside for anyone)."""
        (self.free_queue if block.ahead_of is None else self.ahead_queue).remove(block)
        block.ahead_of = None
        return block

    def _window(self, last: KVBlock) -> list[KVBlock]:
        """The AHEAD_BLOCKS blocks physically after ``last`` (fewer at the pool's end)."""
        return self.blocks[last.block_id + 1 : last.block_id + 1 + AHEAD_BLOCKS]

    def _set_aside(self, last: KVBlock, owner: str) -> None:
        for block in self._window(last):
            if block.ahead_of == owner:
                continue
            if block.ahead_of is not None or block.block_hash is not None or not self.free_queue.contains(block):
                break
            self.free_queue.remove(block)
            self.ahead_queue.append(block)
            block.ahead_of = owner

    def release_ahead(self, owner: str, last: KVBlock | None) -> None:
        """Return the blocks set aside behind ``last`` for ``owner`` (it finished, left or was preempted) to the
        front of the free queue, in address order."""
        if last is None:
            return
        for block in reversed(self._window(last)):
            if block.ahead_of == owner:
                self.free_queue.appendleft(self._unqueue(block))

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block, reviving free (cached) ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self._unqueue(block)
            block.ref_count += 1

    def release(self, blocks_deepest_first: Sequence[KVBlock]) -> None:
        """Drop one reference on each block.

        Blocks that become free and still hold a hash go to the back of the queue in the order given
        (callers pass deepest block first, so a chain's tail is evicted before its shared head).
        Blocks with nothing reusable go to the front: they are the cheapest to hand out.
        """
        for block in blocks_deepest_first:
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)
            elif block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} released more often than taken")

    def cache_block(self, block: KVBlock, block_hash: BlockHash, parent: object, token_ids: tuple[int, ...],
                    parent_hash: BlockHash | None = None) -> None:
        """Make a full block findable. The first block registered under a hash keeps it, unless it is free and
        chained to another parent: such a block is unreachable from this chain (lookups check the parent), and
        a sequence recomputing the chain after a preemption would otherwise never be found again."""
        if block.block_hash is not None:
            return
        old = self.cached.get(block_hash)
        if old is not None:
            if old.ref_count > 0 or (old.parent == parent and old.token_ids == token_ids):
                return
            del self.cached[block_hash]
            for listener in self.listeners:
                listener.block_evicted(old)
            old.clear_hash()
        block.block_hash = block_hash
        block.parent = parent
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        block.epoch += 1
        self.cached[block_hash] = block
        for listener in self.listeners:
            listener.block_stored(block)

    def lookup(self, block_hash: BlockHash, parent: object, token_ids: tuple[int, ...]) -> KVBlock | None:
        """A cached block for this prefix, verified on content and on the exact parent (the chain's isolation
        keys, or the previous block's identity): a hash collision, even of the whole chain, is a miss."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent != parent:
            return None
        return block

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after a failed step left KV contents in doubt)."""
        n = len(self.cached)
        for block in self.cached.values():
            block.clear_hash()
        self.cached.clear()
        for listener in self.listeners:
            listener.cleared()
        return n

"""The device block pool: ref counts, the free/eviction queue and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpage.kv.block import FreeBlockQueue, KVBlock
from kvpage.kv.prefix_hash import BlockHash


class BlockPool:
    """``num_blocks`` interchangeable blocks.

    Every block is either in use (ref_count >= 1, in one or more block tables) or free (ref_count 0,
    in the free queue). A free block may still hold a cached hash; it keeps its KV data until the
    pool hands it out again, at which point the hash is evicted.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the LRU end, evicting any cached hash they still carry."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot take {n} blocks: only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.clear_hash()
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block, reviving free (cached) ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
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

    def cache_block(self, block: KVBlock, block_hash: BlockHash, parent: object, token_ids: tuple[int, ...]) -> None:
        """Make a full block findable. The first block registered under a hash keeps it."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.parent = parent
        block.token_ids = token_ids
        block.epoch += 1
        self.cached[block_hash] = block

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
        return n

"""One physical KV block and the doubly linked free queue that holds idle blocks.

The free queue is hand-rolled rather than a ``collections.deque`` because a free block that still
carries a prefix hash can be revived by a cache hit: it must leave the middle of the queue in O(1).
"""

from __future__ import annotations

from collections.abc import Iterator

DEFAULT_BLOCK_SIZE = 16  # tokens per block: the engine's, the simulator's and the planner's default


class KVBlock:
    """Bookkeeping for one physical block (no tensor data lives here)."""

    __slots__ = ("ahead_of", "block_hash", "block_id", "epoch", "next_free", "parent", "parent_hash", "prev_free",
                 "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Prefix-cache identity of a full block; None while the block is partial or uncached. ``parent`` names
        # exactly what precedes it (the chain's isolation keys, or the previous block's (id, epoch)), so reuse
        # never rests on a hash comparison alone; ``epoch`` counts the cached identities this block has had.
        self.block_hash: bytes | None = None
        self.parent: object = None
        self.parent_hash: bytes | None = None  # the chain's previous hash (its root hash for a first block)
        self.token_ids: tuple[int, ...] | None = None
        self.epoch = 0
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        # While free: the sequence this block lies just ahead of, set aside for its growth (see BlockPool).
        self.ahead_of: str | None = None

    def clear_hash(self) -> None:
        self.block_hash = None
        self.parent = None
        self.parent_hash = None
        self.token_ids = None

    @property
    def identity(self) -> tuple[int, int]:
        """What a following block records as its parent: this block in its current cached incarnation."""
        return self.block_id, self.epoch

    def __repr__(self) -> str:
        cached = " cached" if self.block_hash is not None else ""
        return f"KVBlock({self.block_id}, ref={self.ref_count}{cached})"


class FreeBlockQueue:
    """Free blocks in eviction order: the front is the least recently used end.

    O(1) ``popleft`` (allocate), ``append`` (free a cached block: evicted last),
    ``appendleft`` (free an uncached block: reused first) and ``remove`` (revive a cached block).
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def first(self) -> KVBlock | None:
        """The block popleft would return, or None."""
        block = self._head.next_free
        return None if block is self._tail else block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self._head.next_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def contains(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        """Front (next to be evicted) to back."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

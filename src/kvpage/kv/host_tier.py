"""The host tier: one array of host KV blocks for swapped-out sequences and for offloaded prefix blocks.

Swap-out and prefix offload share one set of host slots, so swap space and ``kv_offload_memory`` are one
mechanism. A slot is free, owned by a swapped sequence (pinned until it returns or is freed), or holds a
prefix block the device pool evicted (an LRU entry, findable by its chained prefix hash). Taking a slot
for a swap-out or a new offload evicts the least recently used prefix entry when no slot is free; swapped
blocks are never evicted.

The slots are list-like (``pop``, ``extend``, ``len``) because the KV managers hand out host blocks that way.

Within one engine step the worker copies device -> host (swap-outs, offloads) before host -> device (swap-ins,
prefix loads). So a slot read by this step's swap-in must not be written by a store planned later in the same
step: ``release_after_read`` keeps such slots out of reach until ``begin_step``; slots loaded from are pinned
the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvpage.kv.prefix_hash import BlockHash


@dataclass(frozen=True)
class TierEntry:
    """A prefix block below the pool: what it holds (its chain position and tokens), not where."""

    block_hash: BlockHash
    # the previous block's hash; for a chain's first block its root hash, a digest of the isolation keys (model,
    # adapter, cache_salt: kv/prefix_hash.py), so matching the parent checks those keys too
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    first: bool = False  # the first block of its chain (its events name no parent)

    def matches(self, parent_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Verified on content and on the parent, not on the block's own hash alone."""
        return self.token_ids == token_ids and self.parent_hash == parent_hash


class HostTier:
    """``num_slots`` host blocks. ``offload``: evicted device prefix blocks are kept here (else swap only)."""

    def __init__(self, num_slots: int, offload: bool = False) -> None:
        if num_slots < 0:
            raise ValueError(f"host slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.offload = offload
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.cached: OrderedDict[BlockHash, tuple[int, TierEntry]] = OrderedDict()  # LRU first
        self._held: set[int] = set()  # prefix entries a load of this step reads: not evicted until begin_step
        self._after_read: list[int] = []
        self.on_removed: Callable[[list[BlockHash]], None] | None = None
        self.num_evictions = 0
        self.num_stored = 0

    # ------------------------------------------------------------- list-like
    def __len__(self) -> int:
        """Slots a swap-out may take now: free ones and evictable prefix entries (held ones are all cached)."""
        return len(self._free) + len(self.cached) - len(self._held)

    def __iter__(self) -> Iterator[int]:
        """Every slot no swapped sequence owns (free, prefix entries, released this step)."""
        yield from self._free
        for slot, _ in self.cached.values():
            yield slot
        yield from self._after_read

    def pop(self) -> int:
        """A slot for a swap-out (evicting the least recently used prefix entry if none is free)."""
        slot = self._take()
        if slot is None:
            raise IndexError("the host tier is full of swapped blocks")
        return slot

    def extend(self, slots: Iterable[int]) -> None:
        """Slots back from a swapped sequence that was freed (its blocks are not read this step)."""
        self._free.extend(slots)

    def release_after_read(self, slots: Iterable[int]) -> None:
        """Slots a swap-in reads this step: free again from the next step on (only a store could overwrite
        them within the step, and stores exist only with offload)."""
        if self.offload:
            self._after_read.extend(slots)
        else:
            self._free.extend(slots)

    @property
    def num_unowned(self) -> int:
        """Slots no swapped sequence owns: for the invariant free + owned == total."""
        return len(self._free) + len(self.cached) + len(self._after_read)

    # --------------------------------------------------------------- prefixes
    def begin_step(self) -> None:
        self._free.extend(reversed(self._after_read))
        self._after_read.clear()
        self._held.clear()

    def store(self, entry: TierEntry) -> int | None:
        """A slot for an evicted device prefix block (the worker copies it there this step); None: the tier is
        full of swapped blocks, or already holds it (then it is refreshed)."""
        if not self.offload:
            return None
        old = self.cached.get(entry.block_hash)
        if old is not None:
            self.cached.move_to_end(entry.block_hash)
            return None
        slot = self._take()
        if slot is None:
            return None
        self.cached[entry.block_hash] = (slot, entry)
        self.num_stored += 1
        return slot

    def find(self, block_hash: BlockHash, parent_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding this exact block, or None. Pure."""
        hit = self.cached.get(block_hash)
        if hit is None or not hit[1].matches(parent_hash, token_ids):
            return None
        return hit[0]

    def hold(self, block_hash: BlockHash) -> None:
        """A load from this entry is planned this step: most recently used, and not evicted before it is read."""
        slot, _ = self.cached[block_hash]
        self.cached.move_to_end(block_hash)
        self._held.add(slot)

    def clear(self) -> int:
        """Forget every prefix entry (reset_prefix_cache); swapped blocks stay. Returns how many."""
        n = len(self.cached)
        if n and self.on_removed is not None:
            self.on_removed(list(self.cached))
        for slot, _ in self.cached.values():
            if slot in self._held:
                self._after_read.append(slot)
            else:
                self._free.append(slot)
        self.cached.clear()
        self._held.clear()
        return n

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, (slot, _) in self.cached.items():
            if slot not in self._held:
                del self.cached[h]
                self.num_evictions += 1
                if self.on_removed is not None:
                    self.on_removed([h])
                return slot
        return None

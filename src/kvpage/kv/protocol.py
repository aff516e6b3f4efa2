"""What the scheduler may ask of a KV manager, and what it gets back.

The scheduler sees KV memory only through ``KVManager``: block ids, slot counts and "not now" (None). The
paged manager (paged.py) and the static-reservation baseline (static.py) both implement it, and the
simulator drives them through the same calls as the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvpage.kv.block import KVBlock
from kvpage.kv.offload import TierOps
from kvpage.kv.prefix_hash import BlockHash
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.stats import KVStats


@dataclass(frozen=True)
class PrefixHit:
    """The longest run of cached full blocks matching a sequence's tokens (a sliding-window group's hit has
    None where its window does not reach). A hybrid manager's hit carries one hit per KV group in ``groups``.
    ``loads``: the blocks after ``blocks`` found in the host or disk tier (kv/offload.py), counted in
    ``num_tokens``; admission loads them into fresh blocks."""

    blocks: tuple[KVBlock | None, ...]
    hashes: tuple[BlockHash, ...]
    num_tokens: int
    groups: tuple[PrefixHit, ...] = ()
    loads: tuple = ()

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id if b is not None else -1 for b in self.blocks]


NO_HIT = PrefixHit((), (), 0)


@dataclass(frozen=True)
class Allocation:
    """What one successful allocation changed.

    ``copies`` are (src, dst) device-block copies the worker must perform before writing
    (copy-on-write of a shared partial block, or a static-reservation fork).
    """

    new_blocks: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    num_cached_tokens: int = 0


NOTHING = Allocation()


class KVManager(Protocol):
    """The calls the scheduler (core/scheduler.py), the engine and the simulator make; nothing else."""

    block_size: int
    num_blocks: int
    watermark_blocks: int
    enable_prefix_caching: bool

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_free_swap_blocks(self) -> int: ...

    def has_seq(self, seq_id: str) -> bool: ...

    def is_swapped(self, seq_id: str) -> bool: ...

    def block_table(self, seq_id: str) -> list[int]: ...

    def num_tokens(self, seq_id: str) -> int: ...

    def blocks_needed(self, num_tokens: int) -> int: ...

    def growth_blocks(self, seq_id: str, num_tokens: int, held_tokens: int = 0) -> int: ...

    def reservation_blocks(self, seq: SequenceLike) -> int: ...

    def stranded_free_blocks(self, need_blocks: int) -> int: ...

    def lookup_prefix(self, seq: SequenceLike) -> PrefixHit: ...

    def allocate_slots(self, seq: SequenceLike, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> Allocation | None: ...

    def cache_computed_blocks(self, seq: SequenceLike, num_computed_tokens: int | None = None) -> int: ...

    def free(self, seq: SequenceLike | str) -> None: ...

    def fork(self, parent: SequenceLike | str, child: SequenceLike | str) -> Allocation | None: ...

    def swap_out(self, seq: SequenceLike | str) -> list[tuple[int, int]] | None: ...

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None: ...

    def reset_prefix_cache(self) -> int: ...

    def begin_step(self) -> None: ...

    def take_tier_ops(self) -> TierOps | None: ...

    def stats(self) -> KVStats: ...

    def check_invariants(self) -> None: ...

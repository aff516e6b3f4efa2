"""Where KV memory goes: counters kept by the manager and a snapshot computed on demand."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class KVCounters:
    """Monotonic event counters (cheap to bump on the hot path)."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0


@dataclass(frozen=True)
class KVStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    cached_free_blocks: int  # free, but still holding a reusable prefix block
    num_seqs: int
    num_swapped_seqs: int
    live_tokens: int  # distinct token states stored (a shared block counts once)
    logical_tokens: int  # sum of sequence lengths: what an unshared cache would hold
    allocated_slots: int  # used_blocks * block_size
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    cow_copies: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    swap_blocks_total: int
    swap_blocks_used: int
    tail_waste_slots: int = 0  # empty slots in partly filled blocks (each sequence's last block)
    reserved_unused_slots: int = 0  # slots of held blocks that hold nothing yet (up-front reservations)
    shared_blocks: int = 0  # blocks held by more than one sequence (prefix hits, n > 1 samples, beams)

    @property
    def utilization(self) -> float:
        """Fraction of allocated slots holding a live token."""
        return self.live_tokens / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def internal_waste(self) -> int:
        """Allocated slots holding nothing: ``tail_waste_slots + reserved_unused_slots``."""
        return self.allocated_slots - self.live_tokens

    @property
    def internal_waste_fraction(self) -> float:
        return self.internal_waste / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def pool_usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def sharing_savings_tokens(self) -> int:
        """Token slots saved by sharing (prefix cache hits and forks)."""
        return self.logical_tokens - self.live_tokens

    def as_dict(self) -> dict[str, float | int]:
        d: dict[str, float | int] = asdict(self)
        for name in ("utilization", "internal_waste", "internal_waste_fraction", "pool_usage",
                     "prefix_hit_rate", "sharing_savings_tokens"):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        return (
            f"blocks used {self.used_blocks}/{self.num_blocks} (free {self.free_blocks}, "
            f"cached-free {self.cached_free_blocks}) | live tokens {self.live_tokens} in "
            f"{self.allocated_slots} slots, utilization {self.utilization:.1%}, "
            f"waste {self.internal_waste} | prefix hits {self.prefix_hit_tokens}/{self.prefix_query_tokens} "
            f"tokens | evictions {self.evictions} | CoW copies {self.cow_copies} | "
            f"swapped out/in {self.blocks_swapped_out}/{self.blocks_swapped_in} blocks"
        )


def make_stats(m: Any, fill: dict[int, int], logical: int, num_seqs: int, num_swapped: int,
               c: KVCounters) -> KVStats:
    """A snapshot of manager ``m``'s pool from its held blocks' fills (block id -> tokens stored)."""
    bs, pool = m.block_size, m.pool
    used = m.num_blocks - pool.num_free_blocks
    cached_free = sum(1 for b in pool.cached.values() if b.ref_count == 0)
    return KVStats(
        num_blocks=m.num_blocks,
        block_size=bs,
        used_blocks=used,
        free_blocks=pool.num_free_blocks,
        cached_free_blocks=cached_free,
        num_seqs=num_seqs,
        num_swapped_seqs=num_swapped,
        live_tokens=sum(fill.values()),
        logical_tokens=logical,
        allocated_slots=used * bs,
        prefix_query_tokens=c.prefix_query_tokens,
        prefix_hit_tokens=c.prefix_hit_tokens,
        evictions=pool.num_evictions,
        cow_copies=c.cow_copies,
        blocks_swapped_out=c.blocks_swapped_out,
        blocks_swapped_in=c.blocks_swapped_in,
        swap_blocks_total=m.num_swap_blocks,
        swap_blocks_used=m.num_swap_blocks - m._host_free.num_unowned,
        tail_waste_slots=sum(bs - f for f in fill.values() if f),
        reserved_unused_slots=bs * sum(1 for f in fill.values() if not f),
        shared_blocks=sum(1 for bid in fill if pool.blocks[bid].ref_count > 1),
    )

"""One KV manager over several KV groups (kv/specs.py): the scheduler's single budget over a shared pool.

Each group keeps its own block tables (a paged manager for full attention, a sliding-window one for a
window) and all draw from one ``BlockPool``, so "can this step be allocated?" stays one question: the blocks
every group needs, together, against the free blocks and the watermark. A request's prefix hit is the longest
that every group can serve (full groups need every block before it; sliding groups only the window's).
Copy and swap instructions name pool blocks, which the worker moves in every KV tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpage.kv.block import DEFAULT_BLOCK_SIZE
from kvpage.kv.block_pool import BlockPool
from kvpage.kv.host_tier import HostTier
from kvpage.kv.invariants import check_host, check_pool, check_tables
from kvpage.kv.offload import PrefixTiers, TierOps
from kvpage.kv.paged import KVCacheManager, _sid
from kvpage.kv.protocol import NO_HIT, NOTHING, Allocation, PrefixHit
from kvpage.kv.residual import ResidualKVManager
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.sliding import SlidingWindowKVManager
from kvpage.kv.specs import KVLayout
from kvpage.kv.stats import KVCounters, KVStats, make_stats


class HybridKVManager:
    """The KVManager of a model with several KV groups (``layout``)."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, *,
                 watermark: float = 0.01, enable_prefix_caching: bool = True, num_swap_blocks: int = 0,
                 max_model_len: int | None = None, model_id: str = "", tiers: PrefixTiers | None = None) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark}")
        self.layout = layout
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.watermark = watermark
        self.watermark_blocks = int(num_blocks * watermark)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.num_swap_blocks = num_swap_blocks
        self.tiers = tiers  # the host and disk tiers below the pool, shared by every group
        self._host_free = tiers.host if tiers is not None else HostTier(num_swap_blocks)
        self.groups: list[KVCacheManager] = []
        for g, group in enumerate(layout.groups):
            kw = dict(watermark=0.0, enable_prefix_caching=enable_prefix_caching, num_swap_blocks=num_swap_blocks,
                      max_model_len=max_model_len, model_id=model_id, pool=self.pool, group=g,
                      host_free=self._host_free, tiers=tiers)
            if group.spec.residual:
                self.groups.append(ResidualKVManager(num_blocks, block_size, **kw))  # type: ignore[arg-type]
            elif group.spec.window is None:
                self.groups.append(KVCacheManager(num_blocks, block_size, **kw))  # type: ignore[arg-type]
            else:
                self.groups.append(SlidingWindowKVManager(num_blocks, block_size, window=group.spec.window,
                                                          **kw))  # type: ignore[arg-type]
        self.counters = KVCounters()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._host_free)

    def has_seq(self, seq_id: str) -> bool:
        return self.groups[0].has_seq(seq_id)

    def is_swapped(self, seq_id: str) -> bool:
        return self.groups[0].is_swapped(seq_id)

    def seq_ids(self) -> list[str]:
        return self.groups[0].seq_ids()

    def block_table(self, seq_id: str) -> list[int]:
        return self.groups[0].block_table(seq_id)

    def block_tables(self, seq_id: str) -> list[list[int]]:
        """One block table per KV group, in layout order; -1 marks an entry a sliding window dropped."""
        return [g.block_table(seq_id) for g in self.groups]

    def num_tokens(self, seq_id: str) -> int:
        return self.groups[0].num_tokens(seq_id)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds between steps, over every group."""
        return sum(g.spec.max_blocks(self.block_size, num_tokens) for g in self.layout.groups)

    def growth_blocks(self, seq_id: str, num_tokens: int, held_tokens: int = 0) -> int:
        return sum(g.growth_blocks(seq_id, num_tokens, held_tokens) for g in self.groups)

    def reservation_blocks(self, seq: SequenceLike) -> int:
        return sum(g.reservation_blocks(seq) for g in self.groups)

    def stranded_free_blocks(self, need_blocks: int) -> int:
        return 0

    # ------------------------------------------------------------ prefix cache
    def lookup_prefix(self, seq: SequenceLike) -> PrefixHit:
        """The longest hit every group can serve. Pure."""
        if not self.enable_prefix_caching:
            return NO_HIT
        limit: int | None = None
        hits: list[PrefixHit] = []
        for _ in range(len(self.groups) + 1):  # each pass can only shorten the hit
            hits = [g.lookup_prefix(seq, limit) if isinstance(g, SlidingWindowKVManager)
                    else self._cut(g.lookup_prefix(seq), limit) for g in self.groups]
            shortest = min(h.num_tokens for h in hits)
            if all(h.num_tokens == shortest for h in hits):
                break
            limit = shortest
        else:
            hits = [self._cut(h, min(x.num_tokens for x in hits)) for h in hits]
        n = hits[0].num_tokens
        if n == 0:
            return NO_HIT
        return PrefixHit(hits[0].blocks, hits[0].hashes, n, tuple(hits))

    def _cut(self, hit: PrefixHit, limit: int | None) -> PrefixHit:
        """A full-attention hit shortened to at most ``limit`` tokens (a whole number of blocks)."""
        if limit is None or hit.num_tokens <= limit:
            return hit
        k = limit // self.block_size
        return PrefixHit(hit.blocks[:k], hit.hashes[:k], k * self.block_size,
                         loads=tuple(t for t in hit.loads if t.index < k)) if k else NO_HIT

    def cache_computed_blocks(self, seq: SequenceLike, num_computed_tokens: int | None = None) -> int:
        return sum(g.cache_computed_blocks(seq, num_computed_tokens) for g in self.groups)

    def reset_prefix_cache(self) -> int:
        return sum(g.reset_prefix_cache() for g in self.groups)

    def begin_step(self) -> None:
        self._host_free.begin_step()

    def take_tier_ops(self) -> TierOps | None:
        return self.tiers.take_ops() if self.tiers is not None else None

    # -------------------------------------------------------------- allocation
    def allocate_slots(self, seq: SequenceLike, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> Allocation | None:
        """Slots in every group, or None ("not now") with nothing changed anywhere."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        admitting = not self.has_seq(seq.seq_id)
        hits = _group_hits(prefix_hit, len(self.groups)) if admitting else [None] * len(self.groups)
        if not admitting and prefix_hit is not None and prefix_hit.num_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is already running: a prefix hit only applies at admission")
        need = sum(g.blocks_to_allocate(seq, num_new_tokens, h) for g, h in zip(self.groups, hits, strict=True))
        reserve = (self.watermark_blocks if self.groups[0]._seqs else 0) if admitting else 0
        if self.pool.num_free_blocks - need < reserve:
            return None
        # Every group's hit blocks are held before any group takes new ones, which could evict them otherwise.
        pinned = [b for h in hits if h is not None for b in h.blocks if b is not None]
        self.pool.touch(pinned)
        if self.tiers is not None:  # and every group's tier hits, before any group's new blocks evict host entries
            self.tiers.hold(tuple(t for h in hits if h is not None for t in h.loads))
        new: list[int] = []
        copies: list[tuple[int, int]] = []
        cached = 0
        for g, h in zip(self.groups, hits, strict=True):
            alloc = g.allocate_slots(seq, num_new_tokens, h)
            if alloc is None:  # cannot happen after the check above; never leave a partial allocation
                raise AssertionError(f"group {g.group} refused an allocation the pool had room for")
            new += alloc.new_blocks
            copies += alloc.copies
            cached = alloc.num_cached_tokens
        self.pool.release(pinned)
        if self.tiers is not None and any(h is not None and h.loads for h in hits):
            self.tiers.count_hit([h.loads for h in hits if h is not None])
        if admitting and self.enable_prefix_caching:
            self.counters.prefix_query_tokens += len(seq.token_ids)
            self.counters.prefix_hit_tokens += prefix_hit.num_tokens if prefix_hit else 0
        if not new and not copies and not cached:
            return NOTHING
        return Allocation(tuple(new), tuple(copies), cached)

    def free(self, seq: SequenceLike | str) -> None:
        for g in self.groups:
            g.free(seq)

    def fork(self, parent: SequenceLike | str, child: SequenceLike | str) -> Allocation | None:
        for g in self.groups:
            g.fork(parent, child)
        return NOTHING

    # -------------------------------------------------------------------- swap
    def swap_out(self, seq: SequenceLike | str) -> list[tuple[int, int]] | None:
        sid = _sid(seq)
        held = sum(sum(1 for b in g._state(sid).table if b is not None) for g in self.groups)
        if held > len(self._host_free):
            return None
        out: list[tuple[int, int]] = []
        for g in self.groups:
            mapping = g.swap_out(sid)
            assert mapping is not None
            out += mapping
        return out

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None:
        need = sum(sum(1 for h in g._swapped_state(seq.seq_id).host_blocks if h is not None) for g in self.groups)
        if self.pool.num_free_blocks - need < (self.watermark_blocks if self.groups[0]._seqs else 0):
            return None
        out: list[tuple[int, int]] = []
        for g in self.groups:
            mapping = g.swap_in(seq)
            assert mapping is not None
            out += mapping
        return out

    # ------------------------------------------------------------------- stats
    def stats(self) -> KVStats:
        fill: dict[int, int] = {}
        logical = 0
        for g in self.groups:
            f, lg = g.fills()
            fill.update(f)
            logical += lg
        c = KVCounters(self.counters.prefix_query_tokens, self.counters.prefix_hit_tokens,
                       *(sum(getattr(g.counters, k) for g in self.groups)
                         for k in ("cow_copies", "blocks_swapped_out", "blocks_swapped_in")))
        return make_stats(self, fill, logical, len(self.groups[0]._seqs), len(self.groups[0]._swapped), c)

    def group_stats(self) -> list[dict[str, int]]:
        """Per group: the blocks and live tokens it holds."""
        out = []
        for grp, g in zip(self.layout.groups, self.groups, strict=True):
            f, _ = g.fills()
            out.append({"group": g.group, "kind": grp.spec.kind, "layers": len(grp.layers), "blocks": len(f),
                        "live_tokens": sum(f.values())})
        return out

    def check_invariants(self) -> None:
        refs: dict[int, int] = {}
        for g in self.groups:
            check_tables(g, refs)
        check_pool(self.pool, refs, {g._owner(sid) for g in self.groups for sid in g._seqs})
        check_host(self.groups, self.num_swap_blocks)
        ids = {frozenset(g._seqs) for g in self.groups}
        assert len(ids) == 1, "the groups disagree on which sequences they hold"


def _group_hits(hit: PrefixHit | None, n: int) -> Sequence[PrefixHit | None]:
    if hit is None or not hit.num_tokens:
        return [None] * n
    groups = hit.groups
    if len(groups) != n:
        raise ValueError("a hybrid manager's prefix hit comes from its own lookup_prefix")
    return groups


__all__ = ["HybridKVManager"]

"""The bookkeeping invariants of a KV manager (docs/architecture.md), checked from its state: the property
tests call this after every operation, against a shadow model (tests/helpers/kv_shadow.py).

A hybrid manager's groups share one pool and one host free list: each group's tables are checked alone
(``check_tables``), the pool and the host tier once for all of them (``check_pool``, ``check_host``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpage.kv.block_pool import BlockPool
    from kvpage.kv.paged import KVCacheManager


def check_invariants(m: KVCacheManager) -> None:
    """Raise AssertionError if an invariant is broken: every block free or in use (never both, never twice),
    ref counts equal to the block tables that hold a block, cached blocks full and findable, host swap
    blocks owned once, and per-sequence table sizes and waste within the manager's policy."""
    refs: dict[int, int] = {}
    check_tables(m, refs)
    check_pool(m.pool, refs, {m._owner(sid) for sid in m._seqs})
    check_host([m], m.num_swap_blocks)


def check_tables(m: KVCacheManager, refs: dict[int, int]) -> None:
    """One manager's (or group's) block tables; adds each held block's references to ``refs``."""
    bs = m.block_size
    window = getattr(m, "window", None)
    for sid, state in m._seqs.items():
        table = state.table
        assert m._table_len_ok(len(table), state.num_tokens), (
            f"{sid}: {len(table)} blocks for {state.num_tokens} tokens")
        assert len(state.hashes) <= state.num_tokens // bs, f"{sid}: hashed a partial block"
        held = [b for b in table if b is not None]
        assert len({b.block_id for b in held}) == len(held), f"{sid}: block listed twice"
        if window is None:
            assert len(held) == len(table), f"{sid}: a full-attention table dropped a block"
        for i, b in enumerate(table):
            if b is None:
                continue
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
            if b.block_hash is not None:
                assert (i + 1) * bs <= state.num_tokens, f"{sid}: cached block {b.block_id} is not full"
                if i < len(state.hashes):
                    assert b.block_hash == state.hashes[i], f"{sid}: block {b.block_id} hash mismatch"
        waste = len(table) * bs - state.num_tokens
        assert m._max_waste_ok(waste), f"{sid}: internal waste {waste} slots"


def check_window_bound(m: KVCacheManager, computed: dict[str, int]) -> None:
    """A sliding-window group, after a step: a sequence whose first n tokens are computed holds no block
    before the window of position n, hence at most ceil((W - 1) / block_size) + 1 blocks once all its slotted
    tokens are computed."""
    window = getattr(m, "window", None)
    if window is None:
        return
    for sid, state in m._seqs.items():
        n = computed.get(sid, state.num_tokens)
        first = m.first_needed_block(n)
        assert all(b is None for b in state.table[:first]), f"{sid}: holds a block its window has passed"
        if n == state.num_tokens:
            held = sum(1 for b in state.table if b is not None)
            assert held <= m.max_held_blocks(), f"{sid}: {held} blocks, window allows {m.max_held_blocks()}"


def check_pool(pool: BlockPool, refs: dict[int, int], owners: set[str]) -> None:
    """The shared pool: queues, ref counts against ``refs`` (every table of every group), the cache map."""
    queued = pool.free_blocks()
    assert len(queued) == pool.num_free_blocks, "free queue length disagrees with its counter"
    for b in pool.ahead_queue:
        assert b.ahead_of is not None and b.block_hash is None, f"block {b.block_id} set aside wrongly"
        assert b.ahead_of in owners, f"block {b.block_id} set aside for {b.ahead_of!r}, which holds no blocks"
    for b in pool.free_queue:
        assert b.ahead_of is None, f"block {b.block_id} in the free queue but set aside"
    assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
    for b in queued:
        assert b.ref_count == 0, f"free block {b.block_id} has ref_count {b.ref_count}"
    for b in pool.blocks:
        assert b.ref_count == refs.get(b.block_id, 0), (
            f"block {b.block_id}: ref_count {b.ref_count} but in {refs.get(b.block_id, 0)} block tables"
        )
    assert len(refs) + len(queued) == pool.num_blocks, "free + in-use != total"
    for h, b in pool.cached.items():
        assert b.block_hash == h, f"cache map entry for block {b.block_id} is stale"
    hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
    assert hashed == len(pool.cached), "a block carries a hash the cache map does not know"


def check_host(managers: Sequence[KVCacheManager], num_swap_blocks: int) -> None:
    """The host tier, shared by ``managers``: each host block free or owned once."""
    host_used = [h for m in managers for s in m._swapped.values() for h in s.host_blocks if h is not None]
    host = managers[0]._host_free
    host_free: Iterable[int] = list(host)
    assert len(set(host_used)) == len(host_used), "a host block is owned twice"
    assert not set(host_used) & set(host_free), "a host block is both free and owned"
    assert len(host_used) + host.num_unowned == num_swap_blocks, "host free + used != total"
    for m in managers:
        assert not set(m._seqs) & set(m._swapped), "a sequence is both running and swapped"

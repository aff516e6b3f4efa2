"""The bookkeeping invariants of a KV manager (docs/architecture.md), checked from its state: the property
tests call this after every operation, against a shadow model (tests/helpers/kv_shadow.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpage.kv.paged import KVCacheManager


def check_invariants(m: KVCacheManager) -> None:
    """Raise AssertionError if an invariant is broken: every block free or in use (never both, never twice),
    ref counts equal to the block tables that hold a block, cached blocks full and findable, host swap
    blocks owned once, and per-sequence table sizes and waste within the manager's policy."""
    pool, bs = m.pool, m.block_size
    queued = pool.free_blocks()
    assert len(queued) == pool.num_free_blocks, "free queue length disagrees with its counter"
    for b in pool.ahead_queue:
        assert b.ahead_of is not None and b.block_hash is None, f"block {b.block_id} set aside wrongly"
        assert b.ahead_of in m._seqs, f"block {b.block_id} set aside for {b.ahead_of!r}, which holds no blocks"
    for b in pool.free_queue:
        assert b.ahead_of is None, f"block {b.block_id} in the free queue but set aside"
    assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
    for b in queued:
        assert b.ref_count == 0, f"free block {b.block_id} has ref_count {b.ref_count}"
    refs: dict[int, int] = {}
    for sid, state in m._seqs.items():
        assert m._table_len_ok(len(state.table), state.num_tokens), (
            f"{sid}: {len(state.table)} blocks for {state.num_tokens} tokens"
        )
        assert len(state.hashes) <= state.num_tokens // bs, f"{sid}: hashed a partial block"
        assert len({b.block_id for b in state.table}) == len(state.table), f"{sid}: block listed twice"
        for i, b in enumerate(state.table):
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
            if b.block_hash is not None:
                assert (i + 1) * bs <= state.num_tokens, f"{sid}: cached block {b.block_id} is not full"
                if i < len(state.hashes):
                    assert b.block_hash == state.hashes[i], f"{sid}: block {b.block_id} hash mismatch"
        waste = len(state.table) * bs - state.num_tokens
        assert m._max_waste_ok(waste), f"{sid}: internal waste {waste} slots"
    for b in pool.blocks:
        assert b.ref_count == refs.get(b.block_id, 0), (
            f"block {b.block_id}: ref_count {b.ref_count} but in {refs.get(b.block_id, 0)} block tables"
        )
    assert len(refs) + len(queued) == m.num_blocks, "free + in-use != total"
    for h, b in pool.cached.items():
        assert b.block_hash == h, f"cache map entry for block {b.block_id} is stale"
    hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
    assert hashed == len(pool.cached), "a block carries a hash the cache map does not know"
    host_used = [h for s in m._swapped.values() for h in s.host_blocks]
    assert len(set(host_used)) == len(host_used), "a host block is owned twice"
    assert not set(host_used) & set(m._host_free), "a host block is both free and owned"
    assert len(host_used) + len(m._host_free) == m.num_swap_blocks, "host free + used != total"
    assert not set(m._seqs) & set(m._swapped), "a sequence is both running and swapped"

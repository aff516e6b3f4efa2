"""Steps the KV manager's unit tests share."""

from __future__ import annotations

from kvpage.kv import KVCacheManager, KVSequence


def admit(m: KVCacheManager, seq: KVSequence, use_cache: bool = True):
    hit = m.lookup_prefix(seq) if use_cache else None
    cached = hit.num_tokens if hit else 0
    alloc = m.allocate_slots(seq, len(seq.token_ids) - cached, hit)
    if alloc is not None:
        m.cache_computed_blocks(seq)
    return alloc

"""Unit tests, one per bookkeeping rule: prefix hashes, hits, isolation, revival and eviction."""

from __future__ import annotations

import subprocess
import sys

from kvpage.kv import KVCacheManager, KVSequence, block_hash, root_hash
from tests.helpers.kv_steps import admit


# ----------------------------------------------------------------- prefix cache
def test_prefix_hit_leaves_one_token_and_chains_blocks():
    m = KVCacheManager(16, 4, watermark=0.0)
    a = KVSequence("A", list(range(1, 13)))  # 3 full blocks
    admit(m, a)
    same = KVSequence("B", list(range(1, 13)))
    hit = m.lookup_prefix(same)
    assert hit.num_tokens == 8  # not 12: the last token must still be computed
    assert hit.block_ids == m.block_table("A")[:2]
    longer = KVSequence("C", [*range(1, 13), 99])
    assert m.lookup_prefix(longer).num_tokens == 12
    # Same second block, different first block: the chain makes it a miss.
    other = KVSequence("D", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.lookup_prefix(other).num_tokens == 0


def test_hit_is_shared_with_ref_counts_and_stats():
    m = KVCacheManager(16, 4, watermark=0.0)
    a = KVSequence("A", list(range(1, 10)))
    admit(m, a)
    b = KVSequence("B", [*range(1, 9), 50, 51])
    alloc = admit(m, b)
    assert alloc.num_cached_tokens == 8
    assert m.block_table("B")[:2] == m.block_table("A")[:2]
    assert [m.ref_count(x) for x in m.block_table("A")] == [2, 2, 1]
    st = m.stats()
    assert st.prefix_query_tokens == 19 and st.prefix_hit_tokens == 8
    assert st.live_tokens == 9 + 2 and st.logical_tokens == 19


def test_cache_salt_isolates_the_whole_chain():
    m = KVCacheManager(16, 4, watermark=0.0)
    admit(m, KVSequence("A", list(range(1, 10)), cache_salt="tenant-a"))
    assert m.lookup_prefix(KVSequence("B", list(range(1, 10)), cache_salt="tenant-b")).num_tokens == 0
    assert m.lookup_prefix(KVSequence("C", list(range(1, 10)))).num_tokens == 0
    assert m.lookup_prefix(KVSequence("D", list(range(1, 10)), cache_salt="tenant-a")).num_tokens == 8
    # The salt seeds the root, so even a deep block differs between tenants.
    r_a, r_b = root_hash(cache_salt="tenant-a"), root_hash(cache_salt="tenant-b")
    assert block_hash(block_hash(r_a, [1, 2, 3, 4]), [5, 6, 7, 8]) != block_hash(
        block_hash(r_b, [1, 2, 3, 4]), [5, 6, 7, 8]
    )


def last_token_hash(data: bytes) -> bytes:
    """A deliberately weak hash: a block's hash is its last token, whatever precedes it; every root collides."""
    return b"root" if data.startswith(b'["kvpage-prefix') else data[-8:]


def test_colliding_roots_never_share_across_isolation_keys():
    m = KVCacheManager(16, 4, watermark=0.0, hash_fn=last_token_hash)
    admit(m, KVSequence("A", list(range(1, 10)), adapter_id="lora-x"))
    assert m.lookup_prefix(KVSequence("B", list(range(1, 10)))).num_tokens == 0
    assert m.lookup_prefix(KVSequence("C", list(range(1, 10)), cache_salt="t")).num_tokens == 0
    assert m.lookup_prefix(KVSequence("D", list(range(1, 10)), adapter_id="lora-x")).num_tokens == 8


def test_swap_in_never_shares_a_block_whose_chain_only_collides():
    """B's third block has A's tokens and, through a colliding chain, A's parent hash: it must be copied back,
    not shared (found by the weak-hash property test)."""
    m = KVCacheManager(16, 4, watermark=0.0, num_swap_blocks=8, hash_fn=last_token_hash)
    admit(m, KVSequence("A", [1, 2, 3, 4, 9, 9, 9, 9, 3, 2, 1, 3, 7]))
    b = KVSequence("B", [5, 5, 5, 4, 1, 1, 1, 9, 3, 2, 1, 3, 7])
    assert m.lookup_prefix(b).num_tokens == 0  # first block: same hash, other tokens
    admit(m, b)
    a_blocks = set(m.block_table("A"))
    out = m.swap_out("B")
    assert out is not None
    back = m.swap_in(b)
    assert back is not None and len(back) == 4, "every host block is copied back"
    assert not a_blocks & set(m.block_table("B"))
    m.check_invariants()


def test_model_and_adapter_ids_isolate():
    m = KVCacheManager(16, 4, watermark=0.0, model_id="m1")
    admit(m, KVSequence("A", list(range(1, 10)), adapter_id="lora-x"))
    assert m.lookup_prefix(KVSequence("B", list(range(1, 10)))).num_tokens == 0
    assert m.lookup_prefix(KVSequence("C", list(range(1, 10)), adapter_id="lora-x")).num_tokens == 8
    assert root_hash("m1") != root_hash("m2")


def test_hash_collision_is_a_miss_not_a_wrong_hit():
    collide = lambda data: b"same"  # noqa: E731 - every block hashes alike
    m = KVCacheManager(16, 4, watermark=0.0, hash_fn=collide)
    admit(m, KVSequence("A", [1, 2, 3, 4, 5]))
    assert m.lookup_prefix(KVSequence("B", [9, 9, 9, 9, 5])).num_tokens == 0
    assert m.lookup_prefix(KVSequence("C", [1, 2, 3, 4, 5])).num_tokens == 4


def test_hashes_are_deterministic_across_processes():
    code = (
        "from kvpage.kv import block_hash, root_hash;"
        "print(block_hash(root_hash('m', None, 'salt'), [1, 2, 3]).hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert outs == {block_hash(root_hash("m", None, "salt"), [1, 2, 3]).hex() + "\n"}


def test_cached_blocks_are_registered_only_once_computed():
    m = KVCacheManager(16, 4, watermark=0.0)
    a = KVSequence("A", list(range(1, 10)))
    m.allocate_slots(a, 9)
    assert m.lookup_prefix(KVSequence("B", list(range(1, 10)))).num_tokens == 0
    assert m.cache_computed_blocks(a, 5) == 1  # only the first block is fully computed
    assert m.lookup_prefix(KVSequence("B", list(range(1, 10)))).num_tokens == 4
    assert m.cache_computed_blocks(a) == 1


def test_freed_blocks_keep_hashes_and_are_revived():
    m = KVCacheManager(8, 4, watermark=0.0)
    a = KVSequence("A", list(range(1, 10)))
    admit(m, a)
    table = m.block_table("A")
    m.free(a)
    assert m.num_free_blocks == 8
    assert m.stats().cached_free_blocks == 2
    b = KVSequence("B", list(range(1, 10)))
    alloc = admit(m, b)
    assert alloc.num_cached_tokens == 8 and m.block_table("B")[:2] == table[:2]
    m.check_invariants()


def test_eviction_takes_uncached_then_deepest_cached_blocks_first():
    m = KVCacheManager(6, 4, watermark=0.0)
    a = KVSequence("A", list(range(1, 14)))  # blocks 0,1,2 full+cached, block 3 partial
    admit(m, a)
    assert m.block_table("A") == [0, 1, 2, 3]
    m.free(a)
    order = [b.block_id for b in m.pool.free_queue]
    # Uncached partial block 3 is reused first; then never-used 4, 5; then the chain tail before its head.
    assert order == [3, 4, 5, 2, 1, 0]
    filler = KVSequence("F", list(range(100, 117)))  # 5 blocks: evicts block 2 and 1, keeps head 0
    admit(m, filler)
    assert m.stats().evictions == 2
    hit = m.lookup_prefix(KVSequence("B", list(range(1, 14))))
    assert hit.block_ids == [0]


def test_reset_prefix_cache():
    m = KVCacheManager(8, 4, watermark=0.0)
    admit(m, KVSequence("A", list(range(1, 10))))
    assert m.reset_prefix_cache() == 2
    assert m.lookup_prefix(KVSequence("B", list(range(1, 10)))).num_tokens == 0
    m.check_invariants()

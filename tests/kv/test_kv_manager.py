"""Unit tests, one per bookkeeping rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpage.kv import (
    BlockPool,
    FreeBlockQueue,
    KVBlock,
    KVCacheManager,
    KVPoolConfig,
    KVSequence,
    StaticReservationManager,
    block_hash,
    make_kv_manager,
    root_hash,
    slot_mapping,
    token_location,
)
from kvpage.kv.specs import group_layers


def admit(m: KVCacheManager, seq: KVSequence, use_cache: bool = True):
    hit = m.lookup_prefix(seq) if use_cache else None
    cached = hit.num_tokens if hit else 0
    alloc = m.allocate_slots(seq, len(seq.token_ids) - cached, hit)
    if alloc is not None:
        m.cache_computed_blocks(seq)
    return alloc


# ------------------------------------------------------------------ free queue
def test_free_queue_orders_and_removes_from_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert not q.contains(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(KVBlock(9))
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_block_pool_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)


# ------------------------------------------------------------ allocation rules
def test_a_free_cached_block_of_another_chain_gives_its_hash_to_a_live_one():
    """The first block registered under a hash keeps it against an identical block of the same chain, and while
    it is held; a free one chained to another parent gives the hash up (it could never be found from the new
    chain: lookups check the parent)."""
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    tokens = (1, 2, 3)
    pool.cache_block(a, b"h", ("parent", 1), tokens)
    pool.cache_block(b, b"h", ("parent", 2), tokens)  # a is held: it keeps the hash
    assert pool.lookup(b"h", ("parent", 1), tokens) is a and b.block_hash is None
    pool.release([a])
    pool.cache_block(c, b"h", ("parent", 1), tokens)  # same chain: the first one keeps it, free or not
    assert pool.lookup(b"h", ("parent", 1), tokens) is a and c.block_hash is None
    pool.cache_block(b, b"h", ("parent", 2), tokens)  # a is free and of another chain: b takes the hash
    assert pool.lookup(b"h", ("parent", 2), tokens) is b and pool.lookup(b"h", ("parent", 1), tokens) is None
    assert a.block_hash is None and pool.num_free_blocks == 2


def test_allocation_grows_one_block_at_a_time_and_slots_follow_the_formula():
    m = KVCacheManager(8, 4, watermark=0.0)
    a = KVSequence("A", [1, 2, 3])
    assert admit(m, a).new_blocks == (0,)
    for t in (4, 5):
        a.token_ids.append(t)
        alloc = m.allocate_slots(a, 1)
        assert alloc is not None
    assert m.block_table("A") == [0, 1]
    assert m.slot_mapping("A", 0, 5) == [0, 1, 2, 3, 4]
    assert token_location([7, 2, 9], 4, 9) == (9, 1)
    assert slot_mapping([7, 2, 9], 4, 3, 3) == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    with pytest.raises(IndexError):
        slot_mapping([7], 4, 3, 2)


def test_sequences_growing_in_turn_keep_consecutive_blocks():
    m = KVCacheManager(64, 4, watermark=0.0)
    seqs = [KVSequence(name, [1, 2, 3, 4]) for name in "ABC"]
    for s in seqs:
        admit(m, s, use_cache=False)
    for _ in range(6):  # one block each, round robin: the order that used to interleave their tables
        for s in seqs:
            s.token_ids.extend([5, 6, 7, 8])
            assert m.allocate_slots(s, 4) is not None
    for s in seqs:
        table = m.block_table(s.seq_id)
        assert table == list(range(table[0], table[0] + 7)), (s.seq_id, table)
    m.check_invariants()


def test_blocks_set_aside_stay_free_and_go_to_whoever_needs_them():
    m = KVCacheManager(10, 4, watermark=0.0)
    a = KVSequence("A", [1, 2, 3])
    admit(m, a, use_cache=False)
    assert m.block_table("A") == [0]
    assert [b.block_id for b in m.pool.ahead_queue] == list(range(1, 9))  # set aside behind A's last block
    assert m.num_free_blocks == 9 and m.stats().free_blocks == 9 and m.stats().used_blocks == 1
    b = KVSequence("B", list(range(100, 112)))  # 3 blocks: the one plain free block, then A's set-aside ones
    assert admit(m, b, use_cache=False) is not None
    assert m.block_table("B")[0] == 9 and len(set(m.block_table("B")) & set(range(1, 9))) == 2
    m.check_invariants()
    a.token_ids.extend([4, 5])  # A's next block was taken: it starts a new run, what it had ahead goes back
    assert m.allocate_slots(a, 2) is not None
    assert m.block_table("A")[1] not in m.block_table("B")
    m.check_invariants()
    c = KVSequence("C", list(range(200, 220)))  # 5 blocks = every block still free
    assert admit(m, c, use_cache=False) is not None and m.num_free_blocks == 0
    m.check_invariants()
    for s in (a, b, c):
        m.free(s)
    assert m.num_free_blocks == 10 and len(m.pool.ahead_queue) == 0
    m.check_invariants()


def test_blocks_set_aside_are_taken_before_a_cached_block_is_evicted():
    m = KVCacheManager(12, 4, watermark=0.0)
    p = KVSequence("P", list(range(1, 9)))  # 2 full blocks, cached once computed
    admit(m, p)
    m.free(p)  # its blocks stay cached, at the back of the queue
    a = KVSequence("A", [50])
    admit(m, a, use_cache=False)  # takes a plain block and sets the following ones aside
    assert len(m.pool.ahead_queue) > 0
    filler = KVSequence("F", list(range(100, 100 + 4 * (m.num_free_blocks - 2))))  # all but the cached two
    assert admit(m, filler, use_cache=False) is not None
    assert m.stats().evictions == 0
    assert m.lookup_prefix(KVSequence("Q", list(range(1, 10)))).num_tokens == 8
    m.check_invariants()


def test_freed_and_swapped_sequences_give_back_what_lay_ahead():
    m = KVCacheManager(32, 4, watermark=0.0, num_swap_blocks=8)
    a, b = KVSequence("A", [1, 2, 3, 4, 5]), KVSequence("B", [6, 7, 8])
    admit(m, a, use_cache=False)
    admit(m, b, use_cache=False)
    assert {blk.ahead_of for blk in m.pool.ahead_queue} == {"A", "B"}
    assert m.swap_out(a) is not None
    assert {blk.ahead_of for blk in m.pool.ahead_queue} == {"B"}
    m.check_invariants()
    m.free(b)
    assert len(m.pool.ahead_queue) == 0 and m.num_free_blocks == 32
    m.check_invariants()


def test_none_on_exhaustion_with_no_partial_allocation():
    m = KVCacheManager(4, 4, watermark=0.0)
    a = KVSequence("A", list(range(12)))
    assert admit(m, a) is not None  # 3 blocks
    b = KVSequence("B", list(range(100, 108)))  # needs 2, only 1 free
    assert m.allocate_slots(b, 8) is None
    assert not m.has_seq("B") and m.num_free_blocks == 1
    # A running sequence that needs 2 more blocks while 1 is free: refused whole, table unchanged.
    assert m.allocate_slots(a, 5) is None
    assert m.block_table("A") == [0, 1, 2] and m.num_tokens("A") == 12
    assert m.allocate_slots(a, 4) is not None
    m.check_invariants()


def test_watermark_applies_to_admission_only():
    m = KVCacheManager(10, 4, watermark=0.2)  # keep 2 blocks free when admitting
    assert m.watermark_blocks == 2
    a = KVSequence("A", list(range(28)))  # 7 blocks
    assert admit(m, a) is not None
    assert m.allocate_slots(KVSequence("B", [1, 2, 3, 4, 5]), 5) is None  # 2 blocks would leave 1 < 2
    assert m.allocate_slots(KVSequence("C", [1]), 1) is not None  # leaves exactly 2
    a.token_ids.extend([0] * 4)
    # ...but a running sequence may take the reserve, down to zero.
    assert m.allocate_slots(a, 8) is not None
    assert m.num_free_blocks == 0
    assert m.allocate_slots(a, 1) is None


def test_watermark_is_not_applied_when_nothing_runs():
    m = KVCacheManager(10, 4, watermark=0.2)
    lone = KVSequence("L", list(range(40)))  # all 10 blocks: only possible with no one to protect
    assert m.allocate_slots(lone, 40) is not None
    m.free(lone)
    m.allocate_slots(KVSequence("A", [1]), 1)
    assert m.allocate_slots(KVSequence("B", list(range(32))), 32) is None  # 8 + A's 1 would leave 1 < 2


def test_watermark_counts_revived_cached_blocks():
    m = KVCacheManager(5, 4, watermark=0.2)  # reserve 1 block
    a = KVSequence("A", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(m, a)
    m.free(a)  # two cached full blocks go back to the free queue
    filler = KVSequence("F", list(range(100, 104)))
    admit(m, filler)  # takes the uncached block
    b = KVSequence("B", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    hit = m.lookup_prefix(b)
    assert hit.num_tokens == 8
    # Reviving 2 cached blocks + 1 new block from 4 free leaves 1 = watermark: allowed.
    assert m.allocate_slots(b, 1, hit) is not None
    m.check_invariants()


def test_max_model_len_is_enforced():
    m = KVCacheManager(10, 4, max_model_len=8)
    s = KVSequence("A", list(range(9)))
    with pytest.raises(ValueError, match="exceeds max_model_len=8"):
        m.allocate_slots(s, 9)
    assert not m.has_seq("A")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(4, 4, watermark=1.5)
    m = KVCacheManager(4, 4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(KVSequence("A", [1]), -1)
    with pytest.raises(KeyError, match="unknown sequence 'nope'"):
        m.free("nope")
    with pytest.raises(ValueError, match="unknown KV policy"):
        make_kv_manager("contiguous", 4)


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


# ------------------------------------------------------------ fork and CoW
def test_fork_shares_everything_and_copies_on_first_write():
    m = KVCacheManager(8, 4, watermark=0.0)
    a = KVSequence("A", [1, 2, 3, 4, 5, 6])
    admit(m, a)
    b = KVSequence("B", list(a.token_ids))
    assert m.fork(a, b).copies == ()
    assert m.block_table("B") == m.block_table("A") == [0, 1]
    assert [m.ref_count(x) for x in (0, 1)] == [2, 2]
    b.token_ids.append(7)
    alloc = m.allocate_slots(b, 1)
    assert alloc.copies == ((1, 2),)  # B copies the shared partial block, then writes its copy
    assert m.block_table("B") == [0, 2] and m.ref_count(1) == 1
    a.token_ids.append(8)
    assert m.allocate_slots(a, 1).copies == ()  # A is the sole owner now: in place
    assert m.stats().cow_copies == 1
    with pytest.raises(ValueError, match="already holds blocks"):
        m.fork(a, b)
    m.check_invariants()


def test_fork_of_full_block_boundary_needs_no_copy():
    m = KVCacheManager(8, 4, watermark=0.0)
    a = KVSequence("A", [1, 2, 3, 4])
    admit(m, a)
    m.fork(a, "B")
    b = KVSequence("B", [1, 2, 3, 4, 9])
    alloc = m.allocate_slots(b, 1)
    assert alloc.copies == () and alloc.new_blocks == (1,)


# ------------------------------------------------------------------- swapping
def test_swap_out_and_in_move_ownership():
    m = KVCacheManager(8, 4, watermark=0.0, num_swap_blocks=3, enable_prefix_caching=False)
    a = KVSequence("A", list(range(1, 10)))
    admit(m, a)
    out = m.swap_out(a)
    assert out == [(0, 0), (1, 1), (2, 2)]
    assert m.is_swapped("A") and m.num_free_blocks == 8 and m.num_free_swap_blocks == 0
    with pytest.raises(RuntimeError, match="swapped out"):
        m.allocate_slots(a, 1)
    back = m.swap_in(a)
    assert [h for h, _ in back] == [0, 1, 2]
    assert m.block_table("A") == [d for _, d in back] and m.num_tokens("A") == 9
    assert m.stats().blocks_swapped_out == 3 and m.stats().blocks_swapped_in == 3
    m.check_invariants()


def test_swap_fails_cleanly_when_host_pool_is_full():
    m = KVCacheManager(8, 4, watermark=0.0, num_swap_blocks=2)
    a = KVSequence("A", list(range(1, 10)))  # 3 blocks > 2 host blocks
    admit(m, a)
    assert m.swap_out(a) is None
    assert m.has_seq("A") and m.block_table("A") == [0, 1, 2] and m.num_free_swap_blocks == 2


def test_swap_in_fails_cleanly_when_device_is_full():
    m = KVCacheManager(4, 4, watermark=0.0, num_swap_blocks=4, enable_prefix_caching=False)
    a = KVSequence("A", list(range(1, 10)))
    admit(m, a)
    m.swap_out(a)
    admit(m, KVSequence("B", list(range(20, 30))))  # takes 3 of 4 blocks
    assert m.swap_in(a) is None
    assert m.is_swapped("A") and m.num_free_swap_blocks == 1
    m.free("A")  # aborting a swapped sequence returns its host blocks
    assert m.num_free_swap_blocks == 4
    m.check_invariants()


def test_swap_in_reuses_blocks_still_cached_on_device():
    m = KVCacheManager(8, 4, watermark=0.0, num_swap_blocks=4)
    a = KVSequence("A", list(range(1, 10)))
    admit(m, a)
    m.swap_out(a)
    back = m.swap_in(a)  # the two full blocks are still cached on device: only the tail moves
    assert len(back) == 1
    assert m.block_table("A")[:2] == [0, 1]
    m.check_invariants()


# --------------------------------------------------------------------- static
def test_static_policy_reserves_max_model_len_and_never_shares():
    m = StaticReservationManager(16, 4, max_model_len=16, watermark=0.0)
    a = KVSequence("A", [1, 2, 3, 4, 5])
    assert len(admit(m, a).new_blocks) == 4
    assert m.lookup_prefix(KVSequence("B", [1, 2, 3, 4, 5])).num_tokens == 0
    b = KVSequence("B", [1, 2, 3, 4, 5])
    admit(m, b)
    assert not set(m.block_table("A")) & set(m.block_table("B"))
    for t in range(11):
        a.token_ids.append(t)
        assert m.allocate_slots(a, 1).new_blocks == ()
    with pytest.raises(ValueError, match="max_model_len"):
        m.allocate_slots(a, 1)
    fork = m.fork(a, "C")
    assert len(fork.new_blocks) == 4 and len(fork.copies) == 4
    assert m.allocate_slots(KVSequence("D", [1]), 1) is not None  # 12 of 16 used: one more fits
    assert m.allocate_slots(KVSequence("E", [1]), 1) is None  # a one-token request still needs 4 blocks
    st = m.stats()
    assert st.used_blocks == 16 and st.live_tokens == 16 + 5 + 16 + 1
    assert st.internal_waste == 64 - 38
    m.check_invariants()


def test_static_policy_fills_the_pool_whatever_the_watermark():
    """A reservation never grows, so the admission watermark (kept free for growing sequences) does not apply:
    a pool of exactly 16 reservations admits 16, not 15."""
    m = make_kv_manager("static", 16 * 128, 16, max_model_len=2048, watermark=0.01)
    n = 0
    while m.allocate_slots(KVSequence(f"s{n}", list(range(100))), 100) is not None:
        n += 1
    assert n == 16 and m.pool.num_free_blocks == 0
    m.check_invariants()
    paged = make_kv_manager("paged", 16 * 128, 16, max_model_len=2048, watermark=0.01)
    while paged.allocate_slots(KVSequence(f"s{n}", list(range(2048))), 2048) is not None:
        n += 1
    assert paged.pool.num_free_blocks >= 20  # the paged policy keeps its reserve (1% of 2048 blocks)


def test_static_policy_requires_room_for_one_reservation():
    with pytest.raises(ValueError, match="needs 8 blocks but the pool has 4"):
        StaticReservationManager(4, 4, max_model_len=32)


def test_paged_admits_more_than_static_on_the_same_pool():
    def count_admitted(m: KVCacheManager) -> int:
        n = 0
        while m.allocate_slots(KVSequence(f"s{n}", list(range(20))), 20) is not None:
            n += 1
        return n

    paged = count_admitted(make_kv_manager("paged", 64, 16, max_model_len=512, watermark=0.0))
    static = count_admitted(make_kv_manager("static", 64, 16, max_model_len=512, watermark=0.0))
    assert (paged, static) == (32, 2)


def test_stats_waste_and_utilization():
    m = KVCacheManager(200, 16, watermark=0.0)
    admit(m, KVSequence("A", list(range(505))), use_cache=False)
    admit(m, KVSequence("B", list(range(1000, 2000))), use_cache=False)
    st = m.stats()
    assert st.allocated_slots == 512 + 1008 and st.internal_waste == 7 + 8
    assert st.utilization == pytest.approx(1505 / 1520)
    d = st.as_dict()
    assert d["internal_waste"] == 15 and "utilization" in d


def test_static_policy_with_kv_groups_reserves_every_group_the_whole_length():
    """The baseline for a model with a sliding window next to full attention: one contiguous run per request
    holding each group's blocks for max_model_len (a contiguous allocator knows no window), forks copying every
    group's filled blocks, swaps moving the whole run."""
    layout = group_layers([4, 4, None])  # two sliding groups and one full group of one layer each
    m = KVPoolConfig(40, 4, "static", watermark=0.0, num_swap_blocks=12).build(16, layout)
    a = KVSequence("A", [1, 2, 3, 4, 5])
    assert m.blocks_needed(5) == 6 and m.reservation_blocks(a) == 12
    assert len(admit(m, a).new_blocks) == 12
    tables = m.block_tables("A")
    assert [len(t) for t in tables] == [4, 4, 4]
    assert [b for t in tables for b in t] == list(range(12)) and m.block_table("A") == tables[0]
    assert m.slot_mapping("A", 4, 1) == [tables[0][1] * 4]
    st = m.stats()
    assert st.used_blocks == 12 and st.live_tokens == 3 * 5
    for t in range(11):
        a.token_ids.append(t)
        assert m.allocate_slots(a, 1).new_blocks == ()
    with pytest.raises(ValueError, match="max_model_len"):
        m.allocate_slots(a, 1)
    fork = m.fork(a, "C")
    assert len(fork.new_blocks) == 12 and len(fork.copies) == 12
    assert [dst for _, dst in fork.copies] == list(fork.new_blocks)
    assert m.allocate_slots(KVSequence("D", [1]), 1) is not None
    assert m.allocate_slots(KVSequence("E", [1]), 1) is None  # 36 of 40 used: a reservation needs 12
    out = m.swap_out("C")
    assert len(out) == 12 and m.num_free_swap_blocks == 0
    assert m.allocate_slots(KVSequence("E", [1]), 1) is not None
    m.free("A")
    back = m.swap_in(KVSequence("C", list(a.token_ids)))
    assert back is not None and len(back) == 12
    assert [len(t) for t in m.block_tables("C")] == [4, 4, 4]
    m.check_invariants()
    with pytest.raises(ValueError, match="needs 48 blocks but the pool has 40"):
        KVPoolConfig(40, 4, "static").build(96, group_layers([4, None]))  # 2 groups x 24 blocks

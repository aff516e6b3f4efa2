"""Unit tests, one per bookkeeping rule: the free queue, allocation, the watermark and bad arguments."""

from __future__ import annotations

import pytest

from kvpage.kv import (
    BlockPool,
    FreeBlockQueue,
    KVBlock,
    KVCacheManager,
    KVSequence,
    make_kv_manager,
    slot_mapping,
    token_location,
)
from tests.helpers.kv_steps import admit


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


# ------------------------------------------------------------------ growth
def test_growth_blocks_counts_what_each_policy_still_hands_out():
    from kvpage.kv import StaticReservationManager
    from kvpage.kv.hybrid import HybridKVManager
    from kvpage.kv.sliding import SlidingWindowKVManager
    from kvpage.kv.specs import group_layers

    paged = KVCacheManager(32, 4)
    seq = KVSequence("s", list(range(1, 11)))
    assert paged.growth_blocks("s", 30) == 8  # not admitted: from nothing to 8 blocks
    assert paged.growth_blocks("s", 30, held_tokens=8) == 6  # a prefix hit's two blocks held already
    paged.allocate_slots(seq, 10)
    assert paged.growth_blocks("s", 30) == 5 and paged.growth_blocks("s", 12) == 0
    window = SlidingWindowKVManager(32, 4, window=6)  # holds ceil(5 / 4) + 1 = 3 blocks at most
    assert window.growth_blocks("s", 30) == 3
    window.allocate_slots(KVSequence("s", list(range(1, 11))), 10)
    assert window.growth_blocks("s", 30) == 0
    static = StaticReservationManager(32, 4, max_model_len=32)
    assert static.growth_blocks("s", 30) == 0  # a reservation holds all of it from admission on
    hybrid = HybridKVManager(group_layers([6, None]), 32, 4)
    assert hybrid.growth_blocks("s", 30) == 3 + 8  # the window's group and the full one

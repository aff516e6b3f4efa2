"""Unit tests, one per bookkeeping rule: forks and copy-on-write, swap, static reservation, stats."""

from __future__ import annotations

import pytest

from kvpage.kv import KVCacheManager, KVPoolConfig, KVSequence, StaticReservationManager, make_kv_manager
from kvpage.kv.specs import group_layers
from tests.helpers.kv_steps import admit


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
def fill_reservation_then_fork(m, a: KVSequence):
    """Grow ``a`` from 5 tokens to max_model_len=16 inside its reservation (no new block), check it can grow no
    further, then fork it as C."""
    for t in range(11):
        a.token_ids.append(t)
        assert m.allocate_slots(a, 1).new_blocks == ()
    with pytest.raises(ValueError, match="max_model_len"):
        m.allocate_slots(a, 1)
    return m.fork(a, "C")


def test_static_policy_reserves_max_model_len_and_never_shares():
    m = StaticReservationManager(16, 4, max_model_len=16, watermark=0.0)
    a = KVSequence("A", [1, 2, 3, 4, 5])
    assert len(admit(m, a).new_blocks) == 4
    assert m.lookup_prefix(KVSequence("B", [1, 2, 3, 4, 5])).num_tokens == 0
    b = KVSequence("B", [1, 2, 3, 4, 5])
    admit(m, b)
    assert not set(m.block_table("A")) & set(m.block_table("B"))
    fork = fill_reservation_then_fork(m, a)
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
    fork = fill_reservation_then_fork(m, a)
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

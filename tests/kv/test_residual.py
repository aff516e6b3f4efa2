"""The residual-key group (kv/residual.py): the filling block's unrounded keys as a KV group of their own."""

from __future__ import annotations

import pytest

from kvpage.kv import KVPoolConfig, KVSequence
from kvpage.kv.hybrid import HybridKVManager
from kvpage.kv.residual import ResidualKVManager
from kvpage.kv.specs import KVSpec, group_layers, single_group, with_residual_keys
from tests.kv.test_kv_manager import admit

BS = 4


def residual_manager(num_blocks: int = 24, **kw) -> HybridKVManager:
    return HybridKVManager(with_residual_keys(single_group(2)), num_blocks, BS, watermark=0.0, **kw)


def test_layout_adds_one_residual_group_per_group_over_the_same_layers():
    base = group_layers([5, 5, None, 5, 5, None])
    layout = with_residual_keys(base)
    assert [g.spec.kind for g in layout.groups] == ["sliding(5)", "sliding(5)", "full"] + ["residual"] * 3
    assert [g.layers for g in layout.groups[3:]] == [g.layers for g in base.groups]
    # layers keep their attention group and tensor; each attention group knows its residual partner
    assert [(layout.group(i), layout.slot(i)) for i in range(6)] == [(base.group(i), base.slot(i)) for i in range(6)]
    assert layout.residual_of == {0: 3, 1: 4, 2: 5} and base.residual_of == {}
    assert with_residual_keys(layout) is layout
    with pytest.raises(ValueError, match="no window"):
        KVSpec(window=4, residual=True)


def test_a_sequence_holds_only_its_filling_block():
    m = residual_manager()
    assert isinstance(m.groups[1], ResidualKVManager)
    assert m.blocks_needed(9) == 3 + 1 and m.blocks_needed(1) == 2
    a = KVSequence("A", list(range(1, 10)))  # 9 tokens: blocks 0-1 complete, block 2 holds one
    admit(m, a)
    full, residual = m.block_tables("A")
    assert len(full) == 3 and all(b >= 0 for b in full)
    assert residual[:2] == [-1, -1] and residual[2] >= 0  # the complete blocks' keys left it at once
    for t in (10, 11, 12):  # fill block 2: at the boundary the sequence holds no residual block
        a.token_ids.append(t)
        assert m.allocate_slots(a, 1) is not None
        m.cache_computed_blocks(a)
    assert all(b == -1 for b in m.block_tables("A")[1])
    assert m.stats().used_blocks == 3
    a.token_ids.append(13)
    alloc = m.allocate_slots(a, 1)
    assert len(alloc.new_blocks) == 2  # a full-attention block and a residual block for position 12
    m.cache_computed_blocks(a)
    m.check_invariants()
    m.free("A")
    assert m.num_free_blocks == m.num_blocks
    m.check_invariants()


def test_prefix_hits_are_not_shortened_and_residual_blocks_are_never_cached():
    m = residual_manager()
    a = KVSequence("A", list(range(1, 11)))
    admit(m, a)
    assert len(m.pool.cached) == 2  # the full group's two complete blocks; none of the residual group's
    b = KVSequence("B", [*range(1, 10), 99])
    hit = m.lookup_prefix(b)
    assert hit.num_tokens == 8
    alloc = m.allocate_slots(b, 2, hit)
    assert alloc.num_cached_tokens == 8 and len(alloc.new_blocks) == 2  # one block in each group
    m.check_invariants()


def test_fork_copies_the_shared_residual_block_on_write():
    m = residual_manager()
    a = KVSequence("A", [1, 2, 3, 4, 5, 6])
    admit(m, a)
    m.fork(a, "B")
    b = KVSequence("B", [1, 2, 3, 4, 5, 6, 7])
    alloc = m.allocate_slots(b, 1)
    assert len(alloc.copies) == 2  # the partial full-attention block and the residual block with its keys
    assert m.block_tables("B")[1][1] != m.block_tables("A")[1][1]
    m.check_invariants()


def test_swap_moves_the_residual_block_with_the_others():
    m = residual_manager(num_swap_blocks=8)
    a = KVSequence("A", [1, 2, 3, 4, 5, 6])
    admit(m, a)
    residual_block = m.block_tables("A")[1][1]
    out = m.swap_out("A")
    assert len(out) == 3  # two full-attention blocks and the residual one
    host_residual = dict(out)[residual_block]
    back = m.swap_in(a)  # (the full group's first block is still cached on the device: reused, not copied)
    assert back is not None and (host_residual, m.block_tables("A")[1][1]) in back
    m.check_invariants()


def test_the_paged_policy_builds_a_hybrid_manager_for_residual_keys():
    m = KVPoolConfig(24, BS, "paged", watermark=0.0).build(64, with_residual_keys(single_group(2)))
    assert isinstance(m, HybridKVManager) and [g.spec.kind for g in m.layout.groups] == ["full", "residual"]

"""The pool as data (kv/snapshot.py): each block's state, shared ref counts, tables per KV group, host slots."""

from __future__ import annotations

from kvpage.kv import KVCacheManager, KVPoolConfig
from kvpage.kv.sequence import KVSequence
from kvpage.kv.snapshot import pool_snapshot
from kvpage.kv.specs import group_layers


def admit(m, name, tokens):
    s = KVSequence(name, list(tokens))
    hit = m.lookup_prefix(s)
    assert m.allocate_slots(s, len(tokens) - hit.num_tokens, hit) is not None
    m.cache_computed_blocks(s, len(tokens))
    return s


def test_states_tables_and_counts_agree_with_the_manager():
    m = KVCacheManager(12, 4, num_swap_blocks=4, watermark=0.0)
    admit(m, "a#0", range(10))  # 3 blocks, 2 full
    admit(m, "b#0", [*range(8), 99])  # shares a's 2 full blocks
    m.fork("a#0", "a#1")
    c = admit(m, "c#0", range(50, 58))
    m.free(c)  # its 2 blocks: free, cached
    d = admit(m, "d#0", range(70, 75))
    assert len(m.swap_out(d)) == 2  # its 2 blocks to host slots
    snap = pool_snapshot(m)
    st = m.stats()
    assert len(snap["state"]) == 12 and snap["num_blocks"] == 12 and snap["block_size"] == 4
    assert snap["counts"]["used"] + snap["counts"]["shared"] == st.used_blocks
    assert snap["counts"]["cached_free"] == st.cached_free_blocks
    assert snap["counts"]["shared"] == st.shared_blocks
    for t in snap["tables"]:
        assert t["tables"] == [m.block_table(t["seq"])]
        assert t["request"] == t["seq"].split("#")[0] and t["tokens"] == m.num_tokens(t["seq"])
    for b, rc in snap["ref"].items():
        assert snap["state"][b] == "s" and rc == m.ref_count(b) > 1
    assert snap["swapped"] == ["d#0"] == m.swapped_seq_ids()
    assert snap["host"].count("w") == 2 and len(snap["host"]) == 4


def test_hybrid_groups_are_told_apart():
    m = KVPoolConfig(16, 4, watermark=0.0).build(None, group_layers([6, None, 6]))
    admit(m, "x#0", range(20))
    snap = pool_snapshot(m)
    assert snap["group_kinds"] == [g.spec.kind for g in m.layout.groups]
    (t,) = snap["tables"]
    assert t["tables"] == m.block_tables("x#0")
    for g, table in enumerate(t["tables"]):
        for b in table:
            if b >= 0:
                assert snap["group"][b] == str(g)

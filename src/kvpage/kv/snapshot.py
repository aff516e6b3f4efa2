"""A picture of the block pool as plain data: what the dashboard draws and other tools may read.

``pool_snapshot`` walks the pool once: every block's state as one character (``f`` free, ``c`` free but still
holding a cached prefix that a hit can revive, ``u`` held by one sequence, ``s`` shared by several), the KV
group holding it, ref counts above one, every sequence's block tables (one per KV group; -1 where a sliding
window dropped a block) and the host tier's slots. Torch-free and O(blocks + table entries), so taking one a
few times a second costs a server little (benchmarks/dashboard.py measures it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

STATE_FREE, STATE_CACHED, STATE_USED, STATE_SHARED = "f", "c", "u", "s"


def pool_snapshot(m: Any, request_of: Callable[[str], str] | None = None, max_tables: int = 4096) -> dict[str, Any]:
    """The pool of manager ``m`` (paged, sliding, hybrid or static). ``request_of`` names a sequence's request
    (default: the sequence id up to ``#``); at most ``max_tables`` tables are listed."""
    pool = m.pool
    groups = getattr(m, "groups", [m])
    state = []
    ref: dict[int, int] = {}
    for b in pool.blocks:
        rc = b.ref_count
        if rc == 0:
            state.append(STATE_CACHED if b.block_hash is not None else STATE_FREE)
        elif rc == 1:
            state.append(STATE_USED)
        else:
            state.append(STATE_SHARED)
            ref[b.block_id] = rc
    owner_group = ["-"] * pool.num_blocks
    tables = []
    name = request_of or (lambda sid: sid.split("#", 1)[0])
    sids = list(groups[0]._seqs)
    for sid in sids:
        per_group = []
        for g, grp in enumerate(groups):
            st = grp._seqs.get(sid)
            ids = [] if st is None else [b.block_id if b is not None else -1 for b in st.table]
            for i in ids:
                if i >= 0:
                    owner_group[i] = str(g)
            per_group.append(ids)
        if len(tables) < max_tables:
            tables.append({"seq": sid, "request": name(sid), "tokens": groups[0]._seqs[sid].num_tokens,
                           "tables": per_group})
    host = m._host_free
    host_state = ["f"] * host.num_slots
    for slot, _ in host.cached.values():
        host_state[slot] = "c"
    for grp in groups:  # every group's swapped blocks share the host tier
        for s in grp._swapped.values():
            for slot in s.host_blocks:
                if slot is not None:
                    host_state[slot] = "w"
    layout = getattr(m, "layout", None)
    kinds = [g.spec.kind for g in layout.groups] if layout is not None else (
        ["sliding"] if getattr(m, "window", None) else ["full"])
    return {
        "num_blocks": pool.num_blocks,
        "block_size": m.block_size,
        "state": "".join(state),
        "group": "".join(owner_group) if len(groups) > 1 else None,
        "group_kinds": kinds,
        "ref": ref,
        "tables": tables,
        "num_seqs": len(sids),
        "swapped": list(groups[0]._swapped),
        "host": "".join(host_state),
        "counts": {"free": state.count(STATE_FREE), "cached_free": state.count(STATE_CACHED),
                   "used": state.count(STATE_USED), "shared": state.count(STATE_SHARED)},
    }

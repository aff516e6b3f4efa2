"""A stand-in for the worker's KV tensors, for tests: it applies the manager's instructions to a fake
memory whose every slot records *which token state* it holds. If bookkeeping ever lets a sequence read
a slot holding another prefix (wrong sharing, a missed copy-on-write, a bad swap), the check fails.

Managers with several KV groups write each token into every group's block; a sliding-window group is
checked on the positions the next query's window reads, the only ones it keeps, and a residual-key group on
the positions of the block still filling.
"""

from __future__ import annotations

from kvpage.kv import Allocation, KVCacheManager, KVSequence

# The "K/V" of a token depends on the isolation keys and the whole prefix up to it.
TokenState = tuple[tuple[str | None, str | None], tuple[int, ...]]


def token_state(seq: KVSequence, position: int) -> TokenState:
    return (seq.cache_salt, seq.adapter_id), tuple(seq.token_ids[: position + 1])


class ShadowKV:
    def __init__(self, manager: KVCacheManager) -> None:
        self.m = manager
        self.bs = manager.block_size
        self.device: dict[int, TokenState] = {}
        self.host: dict[int, TokenState] = {}
        layout = getattr(manager, "layout", None)
        self.windows = ([g.spec.window for g in layout.groups] if layout is not None
                        else [getattr(manager, "window", None)])
        self.residual = [g.spec.residual for g in layout.groups] if layout is not None else [False]

    def _tables(self, sid: str) -> list[list[int]]:
        return self.m.block_tables(sid)

    def _copy_blocks(self, src: dict[int, TokenState], dst: dict[int, TokenState], pairs) -> None:
        # Read every source block first: a destination may be a block another pair reads.
        moved = {d: [src.get(s * self.bs + o) for o in range(self.bs)] for s, d in pairs}
        for d, states in moved.items():
            for o, state in enumerate(states):
                if state is None:
                    dst.pop(d * self.bs + o, None)
                else:
                    dst[d * self.bs + o] = state

    def apply_allocation(self, seq: KVSequence, alloc: Allocation, start: int, count: int) -> None:
        """Perform the copies, then 'compute' tokens start..start+count-1 into their slots."""
        self._copy_blocks(self.device, self.device, alloc.copies)
        for table in self._tables(seq.seq_id):
            for pos in range(start, start + count):
                block = table[pos // self.bs]
                assert block >= 0, f"{seq.seq_id}: position {pos} has no block to be written into"
                self.device[block * self.bs + pos % self.bs] = token_state(seq, pos)

    def swap_out(self, pairs) -> None:
        self._copy_blocks(self.device, self.host, pairs)

    def swap_in(self, pairs) -> None:
        self._copy_blocks(self.host, self.device, pairs)

    def check(self, seqs: dict[str, KVSequence], computed: dict[str, int]) -> None:
        """Every computed token of every running sequence reads back its own state."""
        for sid, seq in seqs.items():
            if not self.m.has_seq(sid):
                continue
            n = computed[sid]
            for table, window, residual in zip(self._tables(sid), self.windows, self.residual, strict=True):
                first = n - n % self.bs if residual else 0 if window is None else max(0, n - window + 1)
                for pos in range(first, n):
                    block = table[pos // self.bs]
                    assert block >= 0, f"{sid} position {pos}: its window still reads it, but its block was dropped"
                    slot = block * self.bs + pos % self.bs
                    got = self.device.get(slot)
                    assert got == token_state(seq, pos), (
                        f"{sid} position {pos}: slot {slot} holds {got!r}, expected its own token state"
                    )

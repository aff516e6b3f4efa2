"""A stand-in for the worker's KV tensors, for tests: it applies the manager's instructions to a fake
memory whose every slot records *which token state* it holds. If bookkeeping ever lets a sequence read
a slot holding another prefix (wrong sharing, a missed copy-on-write, a bad swap), the check fails.
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
        for pos, slot in zip(range(start, start + count), self.m.slot_mapping(seq.seq_id, start, count),
                             strict=True):
            self.device[slot] = token_state(seq, pos)

    def swap_out(self, pairs) -> None:
        self._copy_blocks(self.device, self.host, pairs)

    def swap_in(self, pairs) -> None:
        self._copy_blocks(self.host, self.device, pairs)

    def check(self, seqs: dict[str, KVSequence], computed: dict[str, int]) -> None:
        """Every computed token of every running sequence reads back its own state."""
        for sid, seq in seqs.items():
            if not self.m.has_seq(sid):
                continue
            table = self.m.block_table(sid)
            for pos in range(computed[sid]):
                slot = table[pos // self.bs] * self.bs + pos % self.bs
                got = self.device.get(slot)
                assert got == token_state(seq, pos), (
                    f"{sid} position {pos}: slot {slot} holds {got!r}, expected its own token state"
                )

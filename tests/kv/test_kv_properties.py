"""Property tests: random interleavings of admit / prefill chunk / decode / fork / free / swap / prefix
hits, checking every ARCHITECTURE.md invariant and the content of every slot after each step."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpage.kv import KVCacheManager, KVSequence, StaticReservationManager
from kvpage.kv.hybrid import HybridKVManager
from kvpage.kv.invariants import check_window_bound
from kvpage.kv.sliding import SlidingWindowKVManager
from kvpage.kv.specs import group_layers, single_group, with_residual_keys
from tests.helpers.kv_shadow import ShadowKV

BLOCK_SIZE = 4
MAX_LEN = 24
# A tiny alphabet and a few shared prompt heads make prefix hits and collisions frequent.
HEADS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


def weak_hash(data: bytes) -> bytes:
    """Four possible values: nearly every lookup meets a colliding block with other content."""
    return bytes([sum(data) % 4])


class KVMachine(RuleBasedStateMachine):
    make_manager = staticmethod(
        lambda: KVCacheManager(24, BLOCK_SIZE, watermark=0.1, num_swap_blocks=10, max_model_len=MAX_LEN)
    )

    def __init__(self) -> None:
        super().__init__()
        self.m = self.make_manager()
        self.shadow = ShadowKV(self.m)
        self.seqs: dict[str, KVSequence] = {}
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _running(self) -> list[str]:
        return sorted(s for s in self.seqs if self.m.has_seq(s))

    def _swapped(self) -> list[str]:
        return sorted(s for s in self.seqs if self.m.is_swapped(s))

    def _compute(self, seq: KVSequence, n: int, alloc) -> None:
        start = self.computed[seq.seq_id]
        self.shadow.apply_allocation(seq, alloc, start, n)
        self.computed[seq.seq_id] = start + n
        self.m.cache_computed_blocks(seq)

    @rule(
        head=st.sampled_from(range(len(HEADS))),
        tail=st.lists(st.integers(1, 3), max_size=8),
        salt=st.sampled_from([None, None, "tenant-b"]),
        adapter=st.sampled_from([None, None, "lora-1"]),
        chunk=st.integers(1, 16),
    )
    def admit(self, head, tail, salt, adapter, chunk):
        tokens = (HEADS[head] + tail)[:MAX_LEN]
        seq = KVSequence(self._new_id(), tokens, cache_salt=salt, adapter_id=adapter)
        hit = self.m.lookup_prefix(seq)
        assert hit.num_tokens < len(tokens), "a hit must leave at least one token to compute"
        assert hit.num_tokens % BLOCK_SIZE == 0
        n = min(chunk, len(tokens) - hit.num_tokens)
        free_before = self.m.num_free_blocks
        alloc = self.m.allocate_slots(seq, n, hit)
        if alloc is None:
            assert not self.m.has_seq(seq.seq_id)
            assert self.m.num_free_blocks == free_before, "a refused admission changed the pool"
            return
        assert alloc.num_cached_tokens == hit.num_tokens
        self.seqs[seq.seq_id] = seq
        self.prompt_len[seq.seq_id] = len(tokens)
        self.computed[seq.seq_id] = hit.num_tokens
        self._compute(seq, n, alloc)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), tok=st.integers(1, 3), chunk=st.integers(1, 8))
    def step(self, data, tok, chunk):
        """Continue a prefill chunk, or decode one token."""
        sid = data.draw(st.sampled_from(self._running()))
        seq = self.seqs[sid]
        done = self.computed[sid]
        if done < self.prompt_len[sid]:
            n = min(chunk, self.prompt_len[sid] - done)
        else:
            if len(seq.token_ids) >= MAX_LEN:
                return
            seq.token_ids.append(tok)
            n = 1
        table_before = self.m.block_table(sid)
        alloc = self.m.allocate_slots(seq, n)
        if alloc is None:
            assert self.m.block_table(sid) == table_before, "a refused growth changed the block table"
            if done >= self.prompt_len[sid]:
                seq.token_ids.pop()
            return
        self._compute(seq, n, alloc)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fork(self, data):
        parent = self.seqs[data.draw(st.sampled_from(self._running()))]
        if self.computed[parent.seq_id] < len(parent.token_ids):
            return  # fork only a sequence whose known tokens are all computed (as after a decode step)
        child = KVSequence(self._new_id(), list(parent.token_ids), parent.cache_salt, parent.adapter_id)
        alloc = self.m.fork(parent, child)
        if alloc is None:
            return
        self.shadow._copy_blocks(self.shadow.device, self.shadow.device, alloc.copies)
        self.seqs[child.seq_id] = child
        self.prompt_len[child.seq_id] = self.prompt_len[parent.seq_id]
        self.computed[child.seq_id] = self.computed[parent.seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def swap_out(self, data):
        sid = data.draw(st.sampled_from(self._running()))
        host_free = self.m.num_free_swap_blocks
        mapping = self.m.swap_out(sid)
        if mapping is None:
            assert self.m.has_seq(sid) and self.m.num_free_swap_blocks == host_free
            return
        self.shadow.swap_out(mapping)

    @precondition(lambda self: self._swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        sid = data.draw(st.sampled_from(self._swapped()))
        mapping = self.m.swap_in(self.seqs[sid])
        if mapping is None:
            assert self.m.is_swapped(sid)
            return
        self.shadow.swap_in(mapping)

    @invariant()
    def bookkeeping_holds(self):
        self.m.check_invariants()
        stats = self.m.stats()
        assert stats.free_blocks + stats.used_blocks == stats.num_blocks
        assert stats.live_tokens <= stats.allocated_slots

    @invariant()
    def every_slot_reads_back(self):
        self.shadow.check(self.seqs, self.computed)

    @invariant()
    def windows_hold_no_passed_block(self):
        for g in getattr(self.m, "groups", [self.m]):
            check_window_bound(g, self.computed)

    def teardown(self):
        for sid in list(self.seqs):
            self.m.free(sid)
        self.m.check_invariants()
        assert self.m.num_free_blocks == self.m.num_blocks, "blocks leaked after freeing everything"
        assert self.m.num_free_swap_blocks == self.m.num_swap_blocks, "host blocks leaked"


class KVMachineWeakHash(KVMachine):
    make_manager = staticmethod(
        lambda: KVCacheManager(24, BLOCK_SIZE, watermark=0.0, num_swap_blocks=10, hash_fn=weak_hash)
    )


class StaticMachine(KVMachine):
    make_manager = staticmethod(
        lambda: StaticReservationManager(40, BLOCK_SIZE, max_model_len=MAX_LEN, num_swap_blocks=12)
    )


class SlidingMachine(KVMachine):
    """One sliding-window group (a Mistral-style model): a window of 6 positions over blocks of 4 tokens, so
    blocks leave while a sequence grows and a hit needs two blocks at most."""

    make_manager = staticmethod(
        lambda: SlidingWindowKVManager(24, BLOCK_SIZE, window=6, watermark=0.1, num_swap_blocks=10,
                                       max_model_len=MAX_LEN)
    )


class HybridMachine(KVMachine):
    """Two sliding-window groups and one full-attention group over one pool (as Gemma 3, scaled down)."""

    make_manager = staticmethod(
        lambda: HybridKVManager(group_layers([5, 5, None, 5, 5, None]), 40, BLOCK_SIZE, watermark=0.1,
                                num_swap_blocks=16, max_model_len=MAX_LEN)
    )


class ResidualMachine(KVMachine):
    """One full-attention group and its residual-key group (int8 pages with keys rounded per channel)."""

    make_manager = staticmethod(
        lambda: HybridKVManager(with_residual_keys(single_group(2)), 30, BLOCK_SIZE, watermark=0.1,
                                num_swap_blocks=12, max_model_len=MAX_LEN)
    )


class HybridResidualMachine(KVMachine):
    """Gemma-3-shaped groups, each with its residual-key group, over one pool."""

    make_manager = staticmethod(
        lambda: HybridKVManager(with_residual_keys(group_layers([5, 5, None, 5, 5, None])), 48, BLOCK_SIZE,
                                watermark=0.1, num_swap_blocks=20, max_model_len=MAX_LEN)
    )


_settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPagedKV = KVMachine.TestCase
TestPagedKV.settings = _settings
TestPagedKVWeakHash = KVMachineWeakHash.TestCase
TestPagedKVWeakHash.settings = _settings
TestStaticKV = StaticMachine.TestCase
TestStaticKV.settings = _settings
TestSlidingKV = SlidingMachine.TestCase
TestSlidingKV.settings = _settings
TestHybridKV = HybridMachine.TestCase
TestHybridKV.settings = _settings
TestResidualKV = ResidualMachine.TestCase
TestResidualKV.settings = _settings
TestHybridResidualKV = HybridResidualMachine.TestCase
TestHybridResidualKV.settings = _settings

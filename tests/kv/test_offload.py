"""The tiers below the pool (kv/offload.py, host_tier.py, disk_tier.py), torch-free: evicted prefix blocks go
down, lookups continue into the tiers, loads and stores are ordered so that no block is read after it was
overwritten, salts never meet, and the disk tier survives restarts and refuses what does not match."""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpage.kv import KVCacheManager, KVPoolConfig
from kvpage.kv.disk_tier import LOCK_NAME, DiskTier
from kvpage.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, DevicePoolEvents, KVEventSink
from kvpage.kv.host_tier import HostTier
from kvpage.kv.offload import PrefixTiers, TierOps
from kvpage.kv.prefix_hash import block_hash, root_hash
from kvpage.kv.sequence import KVSequence
from kvpage.kv.specs import group_layers

BS = 4
PAYLOAD = 40
IDENT = {"model": "m", "kv_dtype": "bfloat16", "block_size": BS}


def make(tmp_path, blocks=8, host=6, disk=True, disk_bytes=1 << 20, events=None, windows=None):
    """A manager over tiers; ``windows``: one per layer (None = full attention), for sliding and hybrid groups."""
    d = DiskTier(tmp_path / "tier", IDENT, disk_bytes) if disk else None
    tiers = PrefixTiers(HostTier(host, offload=host > 0), d, BS, PAYLOAD, events)
    layout = group_layers(windows) if windows else None
    return KVPoolConfig(blocks, BS, num_swap_blocks=host, watermark=0.0).build(None, layout, tiers)


class Blocks:
    """The bytes the worker would move, as tags: each device block / host slot holds the chain hash of the
    tokens written into it, applied in the worker's order of operations."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.dev: dict[int, bytes | None] = {}
        self.host: dict[int, bytes | None] = {}

    def step(self, seqs: list[KVSequence], frees: list[KVSequence] = (), swap_out: list[KVSequence] = (),
             swap_in: list[KVSequence] = ()) -> list[KVSequence]:
        """One engine step, in the scheduler's order: swap-outs, swap-ins, then admissions (the first that does
        not fit ends them, as first come first served does). Returns the sequences admitted or swapped in."""
        m = self.m
        for s in frees:
            m.free(s)
        m.begin_step()
        outs, ins, done, allocs = [], [], [], {}
        for s in swap_out:
            outs += m.swap_out(s) or []
        for s in swap_in:
            mapping = m.swap_in(s)
            if mapping is not None:
                ins += mapping
                done.append(s)
        for s in seqs:
            hit = m.lookup_prefix(s)
            alloc = m.allocate_slots(s, len(s.token_ids) - hit.num_tokens, hit)
            if alloc is None:
                break
            allocs[s.seq_id] = alloc
            done.append(s)
        ops = m.take_tier_ops() or TierOps()
        # the worker's order: device -> host, device -> disk, host -> device, disk -> device, then the forward pass
        for dev, slot in [*outs, *ops.stores]:
            self.host[slot] = self.dev.get(dev)
        for dev, entry in ops.persists:
            tag = self.dev.get(dev)
            assert tag == entry.block_hash, "a block went to disk after it was overwritten"
            m.tiers.disk.put(entry, tag + b"\0" * (PAYLOAD - len(tag)))
        for slot, dev in [*ins, *ops.loads]:
            self.dev[dev] = self.host.get(slot)
        for payload, dev in ops.disk_loads:
            self.dev[dev] = payload[:32]
        groups = getattr(m, "groups", [m])
        for s in done:
            cached = allocs[s.seq_id].num_cached_tokens if s.seq_id in allocs else len(s.token_ids)
            for g, table in zip(groups, m.block_tables(s.seq_id), strict=True):
                for i, h in enumerate(chain(s, g)):
                    if table[i] < 0:  # a window dropped it
                        continue
                    if (i + 1) * BS <= cached:
                        assert self.dev.get(table[i]) == h, f"{s.seq_id}: block {i} holds the wrong content"
                    else:
                        self.dev[table[i]] = h  # computed by the forward pass
            m.cache_computed_blocks(s, len(s.token_ids))
        if m.tiers.disk is not None:
            m.tiers.disk.flush()
        m.check_invariants()
        return done


def chain(s: KVSequence, group: KVCacheManager | None = None) -> list[bytes]:
    """The chained hashes of a sequence's full blocks (in one KV group's chain: its root names the group)."""
    parent = group._root(s) if group is not None else root_hash("", None, s.cache_salt)
    out = []
    for i in range(len(s.token_ids) // BS):
        parent = block_hash(parent, s.token_ids[i * BS: (i + 1) * BS])
        out.append(parent)
    return out


def seq(name, tokens, salt=None):
    return KVSequence(name, list(tokens), cache_salt=salt)


PROMPTS = [[p * 100 + i for i in range(13)] for p in range(5)]  # 3 full blocks + 1 token each


def run_all(b: Blocks, name: str = "a", salt: str | None = None) -> None:
    """Every prompt once, one at a time (admitted, computed, finished): the pool evicts the oldest ones."""
    for r, p in enumerate(PROMPTS):
        s = seq(f"{name}{r}", p, salt)
        b.step([s])
        b.step([], [s])


def test_evicted_blocks_come_back_from_the_host_tier(tmp_path):
    m = make(tmp_path, disk=False, host=16)
    b = Blocks(m)
    run_all(b)  # each 4 blocks; an 8-block pool holds two
    assert m.tiers.counters.blocks_offloaded > 0
    s = seq("again", PROMPTS[0])
    hit = m.lookup_prefix(s)
    # the chain's head may still be in the pool (tails are evicted first): the rest comes from the host
    assert hit.num_tokens == 12 and len(hit.blocks) + len(hit.loads) == 3
    assert hit.loads and all(h.medium == "host" for h in hit.loads)
    b.step([s])
    assert m.tiers.counters.host_hit_tokens == BS * len(hit.loads)
    assert m.stats().prefix_hit_tokens == 12


def test_disk_tier_serves_after_a_restart_and_salts_never_meet(tmp_path):
    m = make(tmp_path, host=0)
    b = Blocks(m)
    run_all(b, salt="alice")
    m.tiers.close()
    m2 = make(tmp_path, host=0)  # a new engine on the same directory
    assert len(m2.tiers.disk) == m.tiers.counters.blocks_persisted > 0
    assert m2.lookup_prefix(seq("bob", PROMPTS[0], salt="bob")).num_tokens == 0
    assert m2.lookup_prefix(seq("none", PROMPTS[0])).num_tokens == 0
    s = seq("alice", PROMPTS[0], salt="alice")
    assert m2.lookup_prefix(s).num_tokens == 12
    Blocks(m2).step([s])  # loads the bytes written before the restart: checked against the chain
    assert m2.tiers.counters.disk_hit_tokens == 12
    m2.tiers.close()


def test_disk_files_of_another_identity_or_damaged_are_ignored_and_counted(tmp_path):
    m = make(tmp_path, host=0)
    b = Blocks(m)
    run_all(b)
    m.tiers.close()
    files = sorted((tmp_path / "tier").glob("*.kvblock"))
    assert files
    other = DiskTier(tmp_path / "tier", {**IDENT, "block_size": 8}, 1 << 20)
    assert len(other) == 0 and other.counters.ignored_files == len(files)
    other.close()
    # a damaged header is ignored at start; a damaged payload fails its checksum when read
    files[0].write_bytes(b"garbage")
    with open(files[1], "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    d = DiskTier(tmp_path / "tier", IDENT, 1 << 20)
    assert d.counters.ignored_files == 1 and len(d) == len(files) - 1
    bad = bytes.fromhex(files[1].name.split(".")[0])
    assert d.read(bad, PAYLOAD) is None and d.counters.corrupt_blocks == 1
    assert not files[1].exists() and len(d) == len(files) - 2
    truncated = files[2]
    truncated.write_bytes(truncated.read_bytes()[:-5])
    assert d.read(bytes.fromhex(truncated.name.split(".")[0]), PAYLOAD) is None and d.counters.corrupt_blocks == 2
    d.close()


def test_engines_of_other_identities_in_turn_keep_their_own_files(tmp_path):
    """A bfloat16 engine, then an int8 one on the same directory (the lock lets only one at a time), then the
    bfloat16 one again: the second writes its own files beside the first's (same hashes, other identity tags),
    never over them, and the first finds all of its own after; a file named by its hash alone is still read."""
    m = make(tmp_path, host=0)
    run_all(Blocks(m))
    m.tiers.close()
    first = sorted(p.name for p in (tmp_path / "tier").glob("*.kvblock"))
    other = DiskTier(tmp_path / "tier", {**IDENT, "kv_dtype": "int8"}, 1 << 20)
    assert len(other) == 0 and other.counters.ignored_files == len(first)
    m2 = KVPoolConfig(8, BS, num_swap_blocks=0, watermark=0.0).build(
        None, None, PrefixTiers(HostTier(0, offload=False), other, BS, PAYLOAD))
    run_all(Blocks(m2))
    m2.tiers.close()
    both = sorted(p.name for p in (tmp_path / "tier").glob("*.kvblock"))
    assert len(both) == 2 * len(first) and set(first) <= set(both)
    legacy = tmp_path / "tier" / first[0]
    legacy.rename(legacy.with_name(first[0].split(".")[0] + ".kvblock"))
    again = make(tmp_path, host=0)
    assert len(again.tiers.disk) == len(first) and again.tiers.disk.counters.ignored_files == len(first)
    again.tiers.close()


def test_a_failed_disk_block_ends_the_hit_there(tmp_path):
    m = make(tmp_path, host=0)
    b = Blocks(m)
    run_all(b)
    m.tiers.close()
    m2 = make(tmp_path, host=0)
    s = seq("x", PROMPTS[0])
    hashes = chain(s)
    path = tmp_path / "tier" / m2.tiers.disk.file_name(hashes[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    hit = m2.lookup_prefix(s)  # block 0 read and checked; block 1 fails its check: the hit ends before it
    assert hit.num_tokens == 4 and m2.tiers.disk.counters.corrupt_blocks == 1
    assert m2.lookup_prefix(s).num_tokens == 4  # staged: not read again
    alloc = m2.allocate_slots(s, 9, hit)
    assert alloc.num_cached_tokens == 4 and m2.num_tokens("x") == 13
    m2.check_invariants()
    m2.tiers.close()


def test_disk_bound_is_never_exceeded(tmp_path):
    m = make(tmp_path, host=0, disk_bytes=2500)
    b = Blocks(m)
    for r in range(12):
        s = seq(f"a{r}", PROMPTS[r % 5])
        b.step([s])
        b.step([], [s])
        d = m.tiers.disk
        on_disk = sum(p.stat().st_size for p in (tmp_path / "tier").glob("*.kvblock"))
        assert on_disk == d.used_bytes <= 2500
    assert m.tiers.disk.counters.evictions > 0
    m.tiers.close()


def test_a_path_that_cannot_be_a_directory_is_refused_by_name(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        DiskTier(afile, IDENT, 1 << 20)
    with pytest.raises(ValueError, match="cannot be created"):
        DiskTier(afile / "below", IDENT, 1 << 20)  # a directory under a file


def test_a_second_engine_on_one_directory_runs_without_it(tmp_path):
    first = DiskTier(tmp_path / "t", IDENT, 1 << 20)
    second = DiskTier(tmp_path / "t", IDENT, 1 << 20)
    assert first.enabled and not second.enabled
    assert "in use by another kvpage engine" in second.status
    second.close()
    first.close()
    third = DiskTier(tmp_path / "t", IDENT, 1 << 20)  # the lock went with the first
    assert third.enabled
    third.close()
    assert (tmp_path / "t" / LOCK_NAME).exists()


def test_write_failures_are_counted_and_stop_on_a_read_only_directory(tmp_path, monkeypatch):
    m = make(tmp_path, host=0)
    d = m.tiers.disk

    def full(path, head, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write_file", staticmethod(full))
    b = Blocks(m)
    run_all(b)
    assert d.counters.write_errors > 0 and d.writable and len(d) == 0
    assert not list((tmp_path / "tier").glob("*.tmp"))

    def read_only(path, head, payload):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(DiskTier, "_write_file", staticmethod(read_only))
    run_all(b, "b")
    assert not d.writable and d.status == "read-only"
    m.tiers.close()


def test_read_only_directory_is_served_not_written(tmp_path, monkeypatch):
    m = make(tmp_path, host=0)
    b = Blocks(m)
    run_all(b)
    m.tiers.close()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode == os.W_OK else real(p, mode))
    m2 = make(tmp_path, host=0)
    assert not m2.tiers.disk.writable and m2.tiers.disk.status == "read-only"
    s = seq("x", PROMPTS[0])
    Blocks(m2).step([s])
    assert m2.tiers.counters.disk_hit_tokens == 12 and not m2.tiers.counters.blocks_persisted
    m2.tiers.close()


def test_events_rebuild_every_tier(tmp_path):
    sink = KVEventSink(BS)
    m = make(tmp_path, events=sink)
    m.pool.listeners.append(DevicePoolEvents(sink))
    b = Blocks(m)
    for r in range(9):
        s = seq(f"a{r}", PROMPTS[r % 5], salt="s" if r % 3 == 0 else None)
        b.step([s])
        b.step([], [s])
    seen: dict[str, set[bytes]] = {"device": set(), "host": set(), "disk": set()}
    for e in sink.drain():
        if isinstance(e, BlockStored):
            seen[e.medium].update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            seen[e.medium].difference_update(e.block_hashes)
    assert seen["device"] == set(m.pool.cached)
    assert seen["host"] == set(m.tiers.host.cached)
    assert seen["disk"] == set(m.tiers.disk.hashes())
    assert m.reset_prefix_cache() > 0
    events = sink.drain()
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    assert not m.pool.cached and not m.tiers.host.cached and not len(m.tiers.disk)
    m.tiers.close()


def test_swap_and_offload_share_the_host_tier(tmp_path):
    m = make(tmp_path, blocks=8, host=4, disk=False)
    b = Blocks(m)
    s = seq("a", PROMPTS[0])
    b.step([s])
    b.step([], [s])
    t = seq("b", PROMPTS[1])
    b.step([t])  # evicts a's blocks into the host tier (the pool has 8 blocks, a and b 4 each: no eviction yet)
    u = seq("c", PROMPTS[2])
    b.step([u])
    assert len(m.tiers.host.cached) > 0
    mapping = m.swap_out("b")  # swap-out takes slots, evicting prefix entries when none is free
    assert mapping is not None and len(mapping) == 4
    m.check_invariants()
    assert len(m.tiers.host.cached) == 0
    m.free("b")
    m.check_invariants()


LAYOUTS = {"full": None, "sliding": [6, 6], "hybrid": [6, None, 6]}
LONG = [[p * 100 + 50 + i for i in range(25)] for p in range(5)]  # up to 6 full blocks: windows drop some


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 4), st.booleans(), st.integers(0, 3), st.sampled_from(["one", "two", "swap"])),
                min_size=1, max_size=25),
       st.integers(0, 8), st.booleans(), st.sampled_from(sorted(LAYOUTS)))
def test_every_loaded_block_holds_its_prefix(tmp_path_factory, plan, host, disk, layout):
    """Random admissions (one or two in a step), departures, salts, and swap-outs brought back in the same step
    as an admission, over a small pool whose host slots serve swap and offload alike, with or without a disk
    tier, for one full-attention group, one sliding-window group (window 6 = 2 blocks) and both together: every
    block a sequence gets from any tier or from a swap holds exactly its chain's content, and the invariants hold
    after each step."""
    tmp = tmp_path_factory.mktemp("tiers")
    m = make(tmp, blocks=22 if layout == "hybrid" else 14, host=host, disk=disk, disk_bytes=3000,
             windows=LAYOUTS[layout])
    b = Blocks(m)
    live: list[KVSequence] = []
    swapped: list[KVSequence] = []
    for k, (p, salted, suffix, kind) in enumerate(plan):
        new = [seq(f"s{k}", LONG[p][: 9 + 5 * suffix], "x" if salted else None)]
        if kind == "two":
            new.append(seq(f"t{k}", LONG[(p + 1) % 5][: 9 + 5 * (3 - suffix)], "x" if not salted else None))
        frees = live[:-1] if len(live) > 1 else []  # keep at most two holders
        live = live[len(frees):]
        b.step([], frees)
        if kind == "swap" and live and not swapped:
            victim = live.pop()
            b.step([], swap_out=[victim])
            if m.is_swapped(victim.seq_id):
                swapped.append(victim)
            else:
                live.append(victim)
        back = swapped[:1] if kind != "swap" else []
        done = b.step(new, swap_in=back)
        for s in done:
            if s in back:
                swapped.remove(s)
            live.append(s)
    for s in live + swapped:
        m.free(s)
    m.begin_step()  # host slots a swap-in read come back from the next step on
    m.check_invariants()
    assert m.num_free_blocks == m.num_blocks and m.num_free_swap_blocks == m.num_swap_blocks
    if m.tiers.disk is not None:
        m.tiers.close()


def test_tiers_need_prefix_caching():
    with pytest.raises(ValueError, match="enable prefix caching"):
        KVCacheManager(8, BS, num_swap_blocks=2, enable_prefix_caching=False,
                       tiers=PrefixTiers(HostTier(2, offload=True), None, BS, PAYLOAD))

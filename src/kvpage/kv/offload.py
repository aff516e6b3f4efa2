"""Prefix blocks below the device pool: what the pool evicts goes down to the host and disk tiers, and a
prefix lookup continues past the pool's longest hit into them (seed 001's "external" cached tokens).

``PrefixTiers`` listens to the pool: a cached block about to be handed out again is copied to a host slot
(if the host tier has one) and queued for disk (if the disk tier lacks it) by this step's block operations,
which run before anything overwrites the block. A hit in a tier is loaded into a fresh block by the same
operations before the step's forward pass. The manager drains the operations into the scheduler's output each
step (``take_ops``). Torch-free: the worker moves the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from kvpage.kv.block import KVBlock
from kvpage.kv.disk_tier import DiskTier
from kvpage.kv.events import KVEventSink, is_chain_start
from kvpage.kv.host_tier import HostTier, TierEntry
from kvpage.kv.prefix_hash import BlockHash


@dataclass
class TierOps:
    """One step's tier block operations (host slots are indices into the host KV tensors)."""

    stores: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot): device -> host
    persists: list[tuple[int, TierEntry]] = field(default_factory=list)  # device block -> a disk file
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block): host -> device
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)  # (bytes, device block)

    def __bool__(self) -> bool:
        return bool(self.stores or self.persists or self.loads or self.disk_loads)


@dataclass(frozen=True)
class TierHit:
    """A block found below the pool for table position ``index``: in a host slot, or on disk (slot None; its
    checked bytes in ``payload`` once staged)."""

    entry: TierEntry
    slot: int | None
    index: int = -1
    payload: bytes | None = None

    @property
    def medium(self) -> str:
        return "disk" if self.slot is None else "host"


@dataclass
class TierCounters:
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    blocks_offloaded: int = 0  # device -> host copies
    blocks_persisted: int = 0  # device -> disk writes queued
    blocks_loaded_host: int = 0
    blocks_loaded_disk: int = 0


def _entry(block: KVBlock) -> TierEntry:
    return TierEntry(block.block_hash, block.parent_hash or b"", block.token_ids, is_chain_start(block.parent))


class PrefixTiers:
    """The host and disk tiers of one KV manager (one full-attention group) and their per-step operations."""

    def __init__(self, host: HostTier, disk: DiskTier | None, block_size: int, payload_bytes: int,
                 events: KVEventSink | None = None, staged_bytes: int = 256 << 20) -> None:
        self.host = host
        self.disk = disk
        # disk payloads read and checked by a lookup, kept until loaded (a waiting request looks up every step)
        self._staged: OrderedDict[BlockHash, bytes] = OrderedDict()
        self.max_staged = max(64, staged_bytes // max(1, payload_bytes))
        self.block_size = block_size
        self.payload_bytes = payload_bytes
        self.counters = TierCounters()
        self._ops = TierOps()
        self.events: KVEventSink | None = None
        self.set_events(events)

    def set_events(self, events: KVEventSink | None) -> None:
        self.events = events
        self.host.on_removed = (lambda hs: events.removed(hs, "host")) if events else None
        if self.disk is not None:
            self.disk.on_removed = (lambda hs: events.removed(hs, "disk")) if events else None
            self.disk.on_stored = (lambda e: events.stored(e.block_hash, None if e.first else e.parent_hash,
                                                           e.token_ids, "disk")) if events else None

    # ------------------------------------------------------ the pool's listener
    def block_stored(self, block: KVBlock) -> None:
        pass

    def block_evicted(self, block: KVBlock) -> None:
        """A cached block the pool hands out again: keep its bytes below (copied before this step overwrites it)."""
        entry = _entry(block)
        slot = self.host.store(entry)
        if slot is not None:
            self._ops.stores.append((block.block_id, slot))
            self.counters.blocks_offloaded += 1
            if self.events is not None:
                self.events.stored(entry.block_hash, None if entry.first else entry.parent_hash, entry.token_ids,
                                   "host")
        if self.disk is not None and self.disk.enabled and self.disk.writable and not self.disk.has(entry.block_hash):
            self._ops.persists.append((block.block_id, entry))
            self.counters.blocks_persisted += 1

    def cleared(self) -> None:
        pass

    def unpersisted(self, cached: list[KVBlock]) -> list[tuple[int, TierEntry]]:
        """The pool's cached blocks the disk tier lacks: written at shutdown, so that a restarted engine finds
        every prefix the pool held, not only the evicted ones."""
        if self.disk is None or not (self.disk.enabled and self.disk.writable):
            return []
        return [(b.block_id, _entry(b)) for b in cached if not self.disk.has(b.block_hash)]

    # ----------------------------------------------------------------- lookups
    def find(self, block_hash: BlockHash, parent_hash: BlockHash, token_ids: tuple[int, ...],
             index: int) -> TierHit | None:
        """This exact block in the host tier, else in the disk tier's index (its bytes not read yet: ``stage``)."""
        slot = self.host.find(block_hash, parent_hash, token_ids)
        if slot is not None:
            return TierHit(self.host.cached[block_hash][1], slot, index)
        if self.disk is not None and self.disk.find(block_hash, parent_hash, token_ids):
            return TierHit(TierEntry(block_hash, parent_hash, token_ids, index == 0), None, index)
        return None

    def stage(self, hit: TierHit) -> TierHit | None:
        """A hit ready to load: a host hit as it is, a disk hit with its bytes read and checked (None if they
        fail: the file is gone and counted)."""
        if hit.slot is not None or hit.payload is not None:
            return hit
        h = hit.entry.block_hash
        payload = self._staged.get(h)
        if payload is None:
            payload = self.disk.read(h, self.payload_bytes) if self.disk is not None else None
            if payload is None:
                return None
            self._staged[h] = payload
            while len(self._staged) > self.max_staged:
                self._staged.popitem(last=False)
        else:
            self._staged.move_to_end(h)
        return replace(hit, payload=payload)

    def hold(self, hits: tuple[TierHit, ...]) -> None:
        """Keep this admission's host hits from eviction until the step's loads have read them."""
        for h in hits:
            if h.slot is not None:
                self.host.hold(h.entry.block_hash)

    def load(self, hits: tuple[TierHit, ...], blocks: list[KVBlock]) -> None:
        """Plan the loads of staged ``hits`` into ``blocks`` (fresh device blocks, one each)."""
        for h, block in zip(hits, blocks, strict=True):
            payload = h.payload
            self._staged.pop(h.entry.block_hash, None)
            if h.slot is not None:
                self._ops.loads.append((h.slot, block.block_id))
                self.counters.blocks_loaded_host += 1
            else:
                self._ops.disk_loads.append((payload, block.block_id))
                self.counters.blocks_loaded_disk += 1

    def count_hit(self, per_group_loads: list[tuple[TierHit, ...]]) -> None:
        """One admission's prompt tokens loaded from each tier: a token counts once, under the tier its KV group
        with the most loads used (several groups load the same positions of a hybrid model)."""
        host = max(sum(1 for t in loads if t.slot is not None) for loads in per_group_loads)
        disk = max(sum(1 for t in loads if t.slot is None) for loads in per_group_loads)
        self.counters.host_hit_tokens += host * self.block_size
        self.counters.disk_hit_tokens += disk * self.block_size

    # ------------------------------------------------------------------- steps
    def take_ops(self) -> TierOps:
        ops, self._ops = self._ops, TierOps()
        return ops

    def clear(self) -> int:
        """Forget every block below the pool (reset_prefix_cache)."""
        n = self.host.clear()
        self._staged.clear()
        if self.disk is not None:
            n += self.disk.clear()
        return n

    def stats(self) -> dict[str, int | str]:
        c = self.counters
        out: dict[str, int | str] = {
            "host_tier_blocks": len(self.host.cached), "host_tier_slots": self.host.num_slots,
            "host_tier_evictions": self.host.num_evictions, "host_hit_tokens": c.host_hit_tokens,
            "disk_hit_tokens": c.disk_hit_tokens, "blocks_offloaded": c.blocks_offloaded,
            "blocks_persisted": c.blocks_persisted, "blocks_loaded_host": c.blocks_loaded_host,
            "blocks_loaded_disk": c.blocks_loaded_disk}
        if self.disk is not None:
            d = self.disk.counters
            out.update(disk_tier_blocks=len(self.disk), disk_tier_bytes=self.disk.used_bytes,
                       disk_tier_max_bytes=self.disk.max_bytes, disk_tier_evictions=d.evictions,
                       disk_ignored_files=d.ignored_files, disk_corrupt_blocks=d.corrupt_blocks,
                       disk_write_errors=d.write_errors, disk_tier_status=self.disk.status)
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

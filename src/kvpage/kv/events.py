"""KV cache events, as vLLM publishes them for KV-aware routers: a block became findable in a tier
(``BlockStored``), stopped being findable (``BlockRemoved``), or every tier was cleared (``AllBlocksCleared``).

A router that applies the stream in order knows which prefix hashes each tier holds. ``medium`` names the tier:
``device`` (the block pool), ``host`` or ``disk``. Hashes are the engine's chained prefix hashes (32 bytes); the
first block of a chain has no parent. The sink is filled by the KV managers and the disk tier's writer thread
and drained once per engine step (engine/kv_events.py publishes each batch).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvpage.kv.prefix_hash import BlockHash

MEDIA = ("device", "host", "disk")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = "device"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventSink:
    """Events in the order they happened, until drained (thread-safe: the disk writer emits too)."""

    block_size: int
    _events: list[KVEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids, medium: str) -> None:
        self.emit(BlockStored([block_hash], parent, list(token_ids), self.block_size, None, medium))

    def removed(self, hashes: list[BlockHash], medium: str) -> None:
        if hashes:
            self.emit(BlockRemoved(list(hashes), medium))

    def drain(self) -> list[KVEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out


class DevicePoolEvents:
    """The block pool's listener that turns its cache changes into device events."""

    def __init__(self, sink: KVEventSink) -> None:
        self.sink = sink

    def block_stored(self, block) -> None:
        self.sink.stored(block.block_hash, block.parent_hash if not is_chain_start(block.parent) else None,
                         block.token_ids, "device")

    def block_evicted(self, block) -> None:
        self.sink.removed([block.block_hash], "device")

    def cleared(self) -> None:
        self.sink.emit(AllBlocksCleared())


def is_chain_start(parent: object) -> bool:
    """A cached block's ``parent`` is its chain's root keys (a tuple starting "root") for a first block, else the
    previous block's identity."""
    return isinstance(parent, tuple) and bool(parent) and parent[0] == "root"

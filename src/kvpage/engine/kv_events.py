"""KV events leave the engine once per step: to in-process callbacks and to a ZeroMQ publisher.

The wire format follows vLLM's publisher, so a router written for it can read kvpage: a PUB socket sends
three frames per batch (topic, an 8-byte big-endian sequence number, a msgpack payload); the payload is the
array ``[timestamp, [event, ...], data_parallel_rank]`` and each event the array of its tag and fields:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``. Hashes are 32-byte binary strings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import fields

from kvpage.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

KVEventCallback = Callable[[list[KVEvent]], None]
_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def encode_event(event: KVEvent) -> list:
    return [type(event).__name__, *(getattr(event, f.name) for f in fields(event))]


def decode_event(item: Sequence) -> KVEvent:
    """An event back from its array (a subscriber's side; the tests use it)."""
    tag, *values = item
    cls = _TYPES.get(tag)
    if cls is None:
        raise ValueError(f"unknown KV event {tag!r}")
    return cls(*values)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    import msgpack

    ts, events, _rank = msgpack.unpackb(payload, raw=False)
    return ts, [decode_event(e) for e in events]


class ZmqEventPublisher:
    """Binds a PUB socket at ``endpoint`` (e.g. ``tcp://*:5557`` or ``ipc:///tmp/kvpage-events``)."""

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise ValueError(f"--kv-events-endpoint needs pyzmq and msgpack (pip install 'kvpage[serve]'): {e}") from e
        self._pack = msgpack.packb
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 1000)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"cannot publish KV events at {endpoint!r}: {e}") from e
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.seq = 0

    def __call__(self, events: list[KVEvent]) -> None:
        payload = self._pack([time.time(), [encode_event(e) for e in events], None], use_bin_type=True)
        self._sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self._sock.close()


def publish(events: list[KVEvent], sinks: Sequence[KVEventCallback]) -> None:
    """Hand one step's events to every sink; a failing sink is logged, never fails the step."""
    for sink in sinks:
        try:
            sink(events)
        except Exception:
            logger.exception("a KV event sink failed")

"""Chained block hashes for the prefix cache.

A full block's hash covers its parent's hash (so it identifies the whole prefix, not just 16 tokens),
its token ids, and -- through the chain's root -- every isolation key: the model, the adapter and the
per-request cache salt. SHA-256 over a fixed byte encoding keeps hashes identical across processes
(Python's ``hash()`` is randomized per process for strings). A hash match alone never grants reuse:
the pool also compares the stored token ids and the exact parent (see ``BlockPool.lookup``).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
HashFn = Callable[[bytes], bytes]


def sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def root_hash(
    model_id: str = "",
    adapter_id: str | None = None,
    cache_salt: str | None = None,
    hash_fn: HashFn = sha256_digest,
) -> BlockHash:
    """The chain's seed: two requests share cached blocks only if all isolation keys agree."""
    keys = json.dumps(["kvpage-prefix-v1", model_id, adapter_id, cache_salt], separators=(",", ":"))
    return hash_fn(keys.encode())


def block_hash(parent: BlockHash, token_ids: Sequence[int], hash_fn: HashFn = sha256_digest) -> BlockHash:
    return hash_fn(parent + array("q", token_ids).tobytes())

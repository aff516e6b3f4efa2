"""Pure-Python KV memory bookkeeping: block pool, prefix cache, block tables, copy-on-write, swap plans.

Never imports torch: the same code drives the real model and the simulator.
"""

from kvpage.kv.block import FreeBlockQueue, KVBlock
from kvpage.kv.block_pool import BlockPool
from kvpage.kv.manager import (
    NO_HIT,
    Allocation,
    KVCacheManager,
    PrefixHit,
    StaticReservationManager,
    make_kv_manager,
)
from kvpage.kv.prefix_hash import block_hash, root_hash
from kvpage.kv.sequence import KVSequence, SequenceLike
from kvpage.kv.slot_mapping import slot_mapping, token_location
from kvpage.kv.stats import KVStats

__all__ = [
    "NO_HIT",
    "Allocation",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVSequence",
    "KVStats",
    "PrefixHit",
    "SequenceLike",
    "StaticReservationManager",
    "block_hash",
    "make_kv_manager",
    "root_hash",
    "slot_mapping",
    "token_location",
]

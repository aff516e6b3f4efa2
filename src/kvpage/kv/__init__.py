"""Pure-Python KV memory bookkeeping: block pool, prefix cache, block tables, copy-on-write, swap plans.

Never imports torch: the same code drives the real model and the simulator.
"""

from kvpage.kv.block import FreeBlockQueue, KVBlock
from kvpage.kv.block_pool import BlockPool
from kvpage.kv.manager import ALLOCATORS, DEFAULT_BLOCK_SIZE, KVPoolConfig, make_kv_manager
from kvpage.kv.paged import KVCacheManager
from kvpage.kv.prefix_hash import block_hash, root_hash
from kvpage.kv.protocol import NO_HIT, Allocation, KVManager, PrefixHit
from kvpage.kv.sequence import KVSequence, SequenceLike
from kvpage.kv.slot_mapping import cdiv, slot_mapping, token_location
from kvpage.kv.static import StaticReservationManager
from kvpage.kv.stats import KVStats

__all__ = [
    "ALLOCATORS",
    "DEFAULT_BLOCK_SIZE",
    "NO_HIT",
    "Allocation",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVManager",
    "KVPoolConfig",
    "KVSequence",
    "KVStats",
    "PrefixHit",
    "SequenceLike",
    "StaticReservationManager",
    "block_hash",
    "cdiv",
    "make_kv_manager",
    "root_hash",
    "slot_mapping",
    "token_location",
]

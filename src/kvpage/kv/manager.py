"""KV managers by name: ``paged`` (paged.py, the engine's) or ``static`` (static.py, the baseline).

The scheduler, the engine and the simulator see either only through ``kv.protocol.KVManager``.
"""

from __future__ import annotations

from kvpage.kv.paged import KVCacheManager
from kvpage.kv.protocol import NO_HIT, Allocation, KVManager, PrefixHit
from kvpage.kv.static import StaticReservationManager


def make_kv_manager(policy: str, num_blocks: int, block_size: int = 16, *, max_model_len: int | None = None,
                    watermark: float = 0.01, num_swap_blocks: int = 0, model_id: str = "",
                    enable_prefix_caching: bool = True, reserve: str = "max") -> KVCacheManager:
    """``paged`` or ``static`` by name (for the engine, the CLI, the simulator and benchmarks); the static
    baseline never shares blocks, so ``enable_prefix_caching`` applies to ``paged`` only. Both satisfy
    ``KVManager``, all the scheduler relies on; tools that inspect a pool (the tracer) may use the rest."""
    if policy == "paged":
        return KVCacheManager(num_blocks, block_size, max_model_len=max_model_len, watermark=watermark,
                              num_swap_blocks=num_swap_blocks, model_id=model_id,
                              enable_prefix_caching=enable_prefix_caching)
    if policy == "static":
        if max_model_len is None:
            raise ValueError("the static reservation policy needs max_model_len")
        return StaticReservationManager(num_blocks, block_size, max_model_len=max_model_len, reserve=reserve,
                                        watermark=watermark, num_swap_blocks=num_swap_blocks, model_id=model_id)
    raise ValueError(f"unknown KV policy {policy!r}: choose 'paged' or 'static'")


__all__ = ["NO_HIT", "Allocation", "KVCacheManager", "KVManager", "PrefixHit", "StaticReservationManager",
           "make_kv_manager"]

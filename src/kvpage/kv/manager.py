"""KV managers by name: ``paged`` (paged.py, the engine's) or ``static`` (static.py, the baseline).

The scheduler, the engine and the simulator see either only through ``kv.protocol.KVManager``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpage.kv.block import DEFAULT_BLOCK_SIZE
from kvpage.kv.host_tier import HostTier
from kvpage.kv.hybrid import HybridKVManager
from kvpage.kv.offload import PrefixTiers
from kvpage.kv.paged import KVCacheManager
from kvpage.kv.protocol import NO_HIT, Allocation, KVManager, PrefixHit
from kvpage.kv.sliding import SlidingWindowKVManager
from kvpage.kv.specs import KVLayout
from kvpage.kv.static import RESERVE_POLICIES, StaticReservationManager

ALLOCATORS = ("paged", "static")


def make_kv_manager(policy: str, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, *,
                    max_model_len: int | None = None, watermark: float = 0.01, num_swap_blocks: int = 0,
                    model_id: str = "", enable_prefix_caching: bool = True, reserve: str = "max",
                    tiers: PrefixTiers | None = None) -> KVCacheManager:
    """``paged`` or ``static`` by name (for the engine, the CLI, the simulator and benchmarks); the static
    baseline never shares blocks, so ``enable_prefix_caching`` applies to ``paged`` only. Both satisfy
    ``KVManager``, all the scheduler relies on; tools that inspect a pool (the tracer) may use the rest."""
    if policy == "paged":
        return KVCacheManager(num_blocks, block_size, max_model_len=max_model_len, watermark=watermark,
                              num_swap_blocks=num_swap_blocks, model_id=model_id,
                              enable_prefix_caching=enable_prefix_caching, tiers=tiers)
    if policy == "static":
        if max_model_len is None:
            raise ValueError("the static reservation policy needs max_model_len")
        return StaticReservationManager(num_blocks, block_size, max_model_len=max_model_len, reserve=reserve,
                                        watermark=watermark, num_swap_blocks=num_swap_blocks, model_id=model_id)
    raise ValueError(f"unknown KV policy {policy!r}: choose 'paged' or 'static'")


@dataclass(frozen=True)
class KVPoolConfig:
    """What a KV manager is built from: the engine fills it from its worker's sizing of the KV memory, the
    simulator from its flags, so both build their pool the same way."""

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    allocator: str = "paged"  # paged, or static: max-length reservations, the baseline paging is measured against
    static_reserve: str = "max"  # static only: max | pow2 | oracle
    num_swap_blocks: int = 0
    enable_prefix_caching: bool = True  # paged only
    watermark: float = 0.01
    model_id: str = ""  # an isolation key of the prefix hashes
    # host slots for prefix blocks the pool evicts (kv/offload.py), beside num_swap_blocks in one host tier: the
    # simulator's --kv-offload-memory (the engine's worker builds its tiers itself, disk included)
    offload_blocks: int = 0

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be 'paged' or 'static', got {self.allocator!r}")
        if self.static_reserve not in RESERVE_POLICIES:
            raise ValueError(f"unknown reservation policy {self.static_reserve!r}: choose one of "
                             f"{', '.join(RESERVE_POLICIES)}")

    def build(self, max_model_len: int | None, layout: KVLayout | None = None,
              tiers: PrefixTiers | None = None) -> KVCacheManager:
        """The manager for a model of this KV ``layout`` (None: one full-attention group): several groups share
        one pool under a hybrid manager, one sliding-window group is a sliding-window manager. ``tiers``: host and
        disk tiers below the pool (one full-attention group, the paged policy)."""
        if self.offload_blocks and tiers is None and self.allocator == "paged" and self.enable_prefix_caching:
            swap = self.num_swap_blocks + self.offload_blocks  # one host tier: swap slots and offload slots
            tiers = PrefixTiers(HostTier(swap, offload=True), None, self.block_size, 0)
            return dataclasses.replace(self, num_swap_blocks=swap, offload_blocks=0).build(max_model_len, layout,
                                                                                           tiers)
        if tiers is not None and self.allocator != "paged":
            raise ValueError("KV offload tiers keep prefix-cache blocks: they need the paged KV policy")
        if layout is not None and (layout.hybrid or layout.groups[0].spec.window is not None):
            if self.allocator == "static":  # every group reserves the whole length: the baseline
                if max_model_len is None:
                    raise ValueError("the static reservation policy needs max_model_len")
                return StaticReservationManager(self.num_blocks, self.block_size, max_model_len=max_model_len,
                                                reserve=self.static_reserve, watermark=self.watermark,
                                                num_swap_blocks=self.num_swap_blocks, model_id=self.model_id,
                                                layout=layout)
            kw = dict(watermark=self.watermark, enable_prefix_caching=self.enable_prefix_caching,
                      num_swap_blocks=self.num_swap_blocks, max_model_len=max_model_len, model_id=self.model_id,
                      tiers=tiers)
            if layout.hybrid:
                return HybridKVManager(layout, self.num_blocks, self.block_size, **kw)  # type: ignore[return-value]
            return SlidingWindowKVManager(self.num_blocks, self.block_size, window=layout.groups[0].spec.window,
                                          **kw)  # type: ignore[arg-type]
        kw: dict = {"reserve": self.static_reserve} if self.allocator == "static" else {
            "enable_prefix_caching": self.enable_prefix_caching}
        if tiers is not None:
            kw["tiers"] = tiers
        return make_kv_manager(self.allocator, self.num_blocks, self.block_size, max_model_len=max_model_len,
                               watermark=self.watermark, num_swap_blocks=self.num_swap_blocks,
                               model_id=self.model_id, **kw)


__all__ = [
    "ALLOCATORS",
    "DEFAULT_BLOCK_SIZE",
    "NO_HIT",
    "Allocation",
    "KVCacheManager",
    "KVManager",
    "KVPoolConfig",
    "PrefixHit",
    "StaticReservationManager",
    "make_kv_manager",
]

"""Series of simulations behind the pictures: one lever moved at a time, everything else held fixed."""

from __future__ import annotations

from typing import Any

from kvpage.sim.cost import CostModel
from kvpage.sim.simulator import SimConfig, SimResult, Simulator
from kvpage.sim.workloads import SimRequest, WorkloadSpec, generate

BLOCK_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)
REQUESTS_PER_PREFIX = (1, 2, 5, 10, 25, 50, 100)


def allocator_pair(config: SimConfig, requests: list[SimRequest], cost: CostModel) -> dict[str, SimResult]:
    """The same stream under static (config's reservation policy) and paged allocation: packing alone."""
    return {
        alloc: Simulator(config.replace(allocator=alloc), requests, cost).run()
        for alloc in ("static", "paged")
    }


def block_size_series(config: SimConfig, requests: list[SimRequest], cost: CostModel,
                      sizes: tuple[int, ...] = BLOCK_SIZES) -> list[tuple[int, dict[str, Any]]]:
    """Paged allocation at the same KV memory (same number of token slots) with different block sizes."""
    slots = config.num_blocks * config.block_size
    out = []
    for bs in sizes:
        if bs * 2 > slots or -(-config.max_model_len // bs) > slots // bs:
            continue
        cfg = config.replace(allocator="paged", block_size=bs, num_blocks=slots // bs)
        out.append((bs, Simulator(cfg, requests, cost).run().summary()))
    return out


def sharing_series(config: SimConfig, cost: CostModel, num_requests: int = 100, prefix_len: int = 1000,
                   per_prefix: tuple[int, ...] = REQUESTS_PER_PREFIX,
                   seed: int = 0) -> list[tuple[int, dict[str, Any]]]:
    """Prefix reuse alone: num_requests requests with a prefix_len system prompt shared by k requests each."""
    cfg = config.replace(allocator="paged", enable_prefix_caching=True)
    out = []
    for k in per_prefix:
        spec = WorkloadSpec("shared-prefix", num_requests, seed, prefix_len=prefix_len,
                            num_prefixes=max(1, num_requests // k))
        out.append((k, Simulator(cfg, generate(spec), cost).run().summary()))
    return out

"""What a simulation measured: a memory sample per step, a record per request, and the summary the reports
and pictures read (utilization, waste by kind, concurrency, preemptions, prefix reuse, latency)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpage.outputs import RequestMetrics

if TYPE_CHECKING:
    from kvpage.sim.simulator import SimConfig


@dataclass(frozen=True)
class StepSample:
    time: float  # simulated seconds at the start of the step
    seconds: float  # step duration
    running: int
    waiting: int
    swapped: int
    allocated_slots: int
    live_slots: int
    logical_slots: int  # what the running sequences would hold without any sharing
    tail_slots: int
    reserved_slots: int
    external_slots: int
    num_tokens: int


@dataclass
class RequestRecord:
    """One simulated request: its shape, and the same ``RequestMetrics`` the engine keeps (simulated clock)."""

    request_id: str
    prompt_len: int
    output_len: int
    num_samples: int
    metrics: RequestMetrics
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def arrival(self) -> float:
        return self.metrics.arrival_time

    @property
    def finished(self) -> float | None:
        return self.metrics.finished_time

    @property
    def ttft(self) -> float | None:
        return self.metrics.time_to_first_token

    @property
    def latency(self) -> float | None:
        return self.metrics.latency


@dataclass
class SimResult:
    config: SimConfig
    cost_model: str
    steps: list[StepSample] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    fork_failures: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_blocks_total: int = 0  # full blocks of declared shared prefixes, over all requests
    cow_copies: int = 0
    evictions: int = 0
    host_hit_tokens: int = 0  # prompt tokens loaded from the host tier below the pool (--kv-offload-memory)

    # ------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        c, st = self.config, self.steps
        makespan = (st[-1].time + st[-1].seconds) if st else 0.0
        alloc = sum(s.allocated_slots for s in st)
        live = sum(s.live_slots for s in st)
        tail = sum(s.tail_slots for s in st)
        reserved = sum(s.reserved_slots for s in st)
        external = sum(s.external_slots for s in st)
        held = alloc + external
        seq_steps = sum(s.running for s in st)
        logical = sum(s.logical_slots for s in st)
        done = [r for r in self.requests if r.finished is not None]
        out_tokens = sum(r.output_tokens for r in self.requests)
        bs = c.block_size
        saved = sum(r.cached_tokens for r in self.requests) // bs
        return {
            "allocator": c.kv.allocator if c.kv.allocator == "paged" else f"static-{c.kv.static_reserve}",
            "block_size": bs,
            "num_blocks": c.num_blocks,
            "requests": len(self.requests),
            "finished": len(done),
            "rejected": len(self.rejected),
            "steps": len(st),
            "makespan_s": makespan,
            "output_tokens": out_tokens,
            "throughput_tok_s": out_tokens / makespan if makespan else 0.0,
            "requests_per_s": len(done) / makespan if makespan else 0.0,
            "utilization": live / alloc if alloc else 0.0,
            "waste_tail": tail / held if held else 0.0,
            "waste_reserved_unused": reserved / held if held else 0.0,
            "waste_external": external / held if held else 0.0,
            "tail_waste_per_seq_tokens": tail / seq_steps if seq_steps else 0.0,
            "peak_concurrency": max((s.running for s in st), default=0),
            "mean_concurrency": seq_steps / len(st) if st else 0.0,
            "peak_kv_usage": max((s.allocated_slots for s in st), default=0) / (c.num_blocks * bs),
            "preemptions": self.num_preemptions,
            "swap_preemptions": self.num_swap_preemptions,
            "fork_failures": self.fork_failures,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0,
            "host_tier_hit_rate": self.host_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0,
            "prefix_blocks_saved": saved,
            "prefix_blocks_total": self.prefix_blocks_total,
            "prefix_blocks_saved_fraction": saved / self.prefix_blocks_total if self.prefix_blocks_total else 0.0,
            "sharing_saved_fraction": 1 - live / logical if logical else 0.0,
            "cow_copies": self.cow_copies,
            "evictions": self.evictions,
            "ttft_s": _dist([r.ttft for r in done]),
            "latency_s": _dist([r.latency for r in done]),
            "latency_per_output_token_s": _dist([r.latency / r.output_len for r in done if r.latency is not None]),
        }


def _dist(values: list[float | None]) -> dict[str, float]:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {}

    def pct(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    return {"mean": statistics.fmean(xs), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": xs[-1]}

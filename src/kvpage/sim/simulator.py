"""Run a request stream through the real Scheduler and KV manager on a simulated clock.

The loop mirrors ``LLMEngine.step``: schedule, (instead of the model) advance the clock by the cost
model's step time, mark the work computed, give every sequence that finished its prompt one new token,
fork n > 1 samples after the prompt, retire sequences that reached their output length. Memory is
sampled right after scheduling, i.e. while the step's blocks are held.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvpage.core.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from kvpage.core.sequence import Request, Sequence, SequenceStatus
from kvpage.kv import KVCacheManager, make_kv_manager
from kvpage.outputs import RequestMetrics
from kvpage.sampling_params import SamplingParams
from kvpage.sim.cost import CostModel, StepFeatures
from kvpage.sim.workloads import SimRequest, TokenSource


@dataclass(frozen=True)
class SimConfig:
    allocator: str = "paged"  # paged | static
    static_reserve: str = "max"  # max | pow2 | oracle (static only)
    block_size: int = 16
    num_blocks: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    preemption_mode: PreemptionMode = "recompute"
    num_swap_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    beam_prune: float = 0.3  # beam workloads: chance per step that a candidate is replaced by a fork
    seed: int = 0
    check_invariants: bool = False  # tests: verify the KV manager's invariants after every step

    def __post_init__(self) -> None:
        if self.allocator not in ("paged", "static"):
            raise ValueError(f"allocator must be 'paged' or 'static', got {self.allocator!r}")
        if not 0.0 <= self.beam_prune <= 1.0:
            raise ValueError(f"beam_prune must be a probability in [0, 1], got {self.beam_prune}")

    def make_kv(self) -> KVCacheManager:
        kw: dict[str, Any] = {"watermark": self.watermark, "num_swap_blocks": self.num_swap_blocks}
        if self.allocator == "static":
            kw["reserve"] = self.static_reserve
        else:
            kw["enable_prefix_caching"] = self.enable_prefix_caching
        return make_kv_manager(self.allocator, self.num_blocks, self.block_size, max_model_len=self.max_model_len, **kw)


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
            "allocator": c.allocator if c.allocator == "paged" else f"static-{c.static_reserve}",
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


class Simulator:
    def __init__(self, config: SimConfig, requests: list[SimRequest], cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self.kv = config.make_kv()
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=config.max_model_len, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs, enable_chunked_prefill=config.enable_chunked_prefill,
                            preemption_mode=config.preemption_mode),
            self.kv,
        )
        self.pending = deque(sorted(requests, key=lambda r: r.arrival))
        self.tokens = TokenSource()
        self.rng = random.Random(config.seed)
        self.clock = 0.0
        self.result = SimResult(config, cost.describe())
        self._records: dict[str, RequestRecord] = {}
        self._spec: dict[str, SimRequest] = {}
        self._order = 0

    # ---------------------------------------------------------------- run
    def run(self, max_steps: int = 10_000_000) -> SimResult:
        sched = self.scheduler
        for _ in range(max_steps):
            self._arrive()
            if not sched.has_unfinished:
                if not self.pending:
                    break
                self.clock = max(self.clock, self.pending[0].arrival)
                continue
            out = sched.schedule()
            if out.is_empty:
                if self.pending:  # nothing fits until more arrive or... nothing can free memory: wait
                    self.clock = max(self.clock, self.pending[0].arrival)
                    continue
                raise RuntimeError(
                    f"simulation stalled at t={self.clock:.3f}s: {len(sched.waiting)} waiting, "
                    f"{len(sched.running)} running, nothing schedulable (the pool is too small for a request)"
                )
            features = StepFeatures.of(out)
            dt = self.cost.step_seconds(features)
            self._sample(dt, features)
            self.clock += dt
            sched.mark_computed(out)
            self._advance(out)
            if self.config.check_invariants:
                self.kv.check_invariants()
        else:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        r = self.result
        s = self.kv.stats()
        r.num_preemptions = sched.num_preemptions
        r.num_swap_preemptions = sched.num_swap_preemptions
        r.prefix_query_tokens, r.prefix_hit_tokens = s.prefix_query_tokens, s.prefix_hit_tokens
        r.cow_copies, r.evictions = s.cow_copies, s.evictions
        r.requests = list(self._records.values())
        return r

    def _arrive(self) -> None:
        while self.pending and self.pending[0].arrival <= self.clock:
            spec = self.pending.popleft()
            try:
                self.scheduler.check_fits(spec.prompt_len, spec.output_len)
            except ValueError as e:
                self.result.rejected.append((spec.request_id, str(e)))
                continue
            ids = self.tokens.prompt(spec)
            params = SamplingParams(n=spec.num_samples, max_tokens=spec.output_len, ignore_eos=True, temperature=1.0)
            req = Request(spec.request_id, None, ids, params, self._order, RequestMetrics(spec.arrival))
            self._order += 1
            seq = Sequence(f"{spec.request_id}#0", req, 0, list(ids), len(ids))
            req.seqs.append(seq)
            self._spec[spec.request_id] = spec
            self._records[spec.request_id] = RequestRecord(
                spec.request_id, spec.prompt_len, spec.output_len, spec.num_samples, req.metrics)
            if spec.prefix_id is not None:
                self.result.prefix_blocks_total += spec.prefix_len // self.config.block_size
            self.scheduler.add(seq)

    # ------------------------------------------------------------- sample
    def _sample(self, dt: float, f: StepFeatures) -> None:
        sched, kv = self.scheduler, self.kv
        s = kv.stats()
        external = 0
        if len(sched.waiting):
            need = kv.reservation_blocks(sched.waiting[0])
            external = kv.stranded_free_blocks(need) * kv.block_size
        self.result.steps.append(StepSample(
            self.clock, dt, len(sched.running), len(sched.waiting), len(sched.swapped), s.allocated_slots,
            s.live_tokens, s.logical_tokens, s.tail_waste_slots, s.reserved_unused_slots, external, f.num_tokens,
        ))

    # ------------------------------------------------------------ advance
    def _advance(self, out: Any) -> None:
        now = self.clock
        by_request: dict[str, list[Sequence]] = {}
        for w in out.work:
            if w.completes_prompt and w.seq.status is SequenceStatus.RUNNING:
                by_request.setdefault(w.seq.request.request_id, []).append(w.seq)
        for rid, seqs in by_request.items():
            req = seqs[0].request
            rec = self._records[rid]
            if req.metrics.first_token_time is None:
                rec.cached_tokens = req.num_cached_tokens
                if req.params.n > 1:  # the prompt was computed once; the other samples share its blocks
                    req.forked = True
                    children = (self._try_fork(seqs[0], i) for i in range(1, req.params.n))
                    seqs += [c for c in children if c is not None]
            elif self._spec[rid].beam_width:
                seqs = self._reshuffle_beams(req, seqs)
            for seq in seqs:
                self._append(seq, rec, now)

    def _try_fork(self, parent: Sequence, index: int) -> Sequence | None:
        child, ok = self.scheduler.fork(parent, index)
        if not ok:
            self.result.fork_failures += 1
        return child if ok else None

    def _reshuffle_beams(self, req: Request, seqs: list[Sequence]) -> list[Sequence]:
        """Beam-like: some candidates lose and are replaced by a fork of a surviving one (which shares
        its blocks; the shared last block is copied on the first divergent write)."""
        losers = [s for s in seqs if self.rng.random() < self.config.beam_prune]
        if len(losers) == len(seqs):
            losers = losers[1:]
        survivors = [s for s in seqs if s not in losers]
        for loser in losers:
            self.scheduler.finish(loser, "pruned")
            child = self._try_fork(self.rng.choice(survivors), len(req.seqs))
            if child is not None:
                survivors.append(child)
        return survivors

    def _append(self, seq: Sequence, rec: RequestRecord, now: float) -> None:
        seq.token_ids.extend(self.tokens.fresh(1))
        rec.output_tokens += 1
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if seq.num_output_tokens >= rec.output_len or len(seq.token_ids) >= self.config.max_model_len:
            self.scheduler.finish(seq, "length")
            if seq.request.finished:
                metrics.finished_time = now

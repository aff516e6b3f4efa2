"""Run a request stream through the engine's own step loop on a simulated clock.

The loop is ``core.engine_core.EngineCore``, the engine's: the same scheduler, KV manager, forks after the
prompt, stops and retiring. Only the worker differs: ``CostModelWorker`` advances the clock by the cost
model's step time instead of running the model, and draws fresh token ids. Memory is sampled right after
scheduling, while the step's blocks are held. Requests arrive on the simulated clock.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvpage.core.engine_core import EngineCore, SampleTask, TokenOutputProcessor
from kvpage.core.scheduler import Scheduler, SchedulerConfig
from kvpage.core.sequence import Request
from kvpage.core.step import StepFeatures
from kvpage.kv import KVCacheManager, KVPoolConfig
from kvpage.kv.specs import KVLayout
from kvpage.sampling_params import SamplingParams
from kvpage.sim.cost import CostModel
from kvpage.sim.cost_worker import CostModelWorker, SimClock
from kvpage.sim.replay import FrameRecorder
from kvpage.sim.result import RequestRecord, SimResult, StepSample
from kvpage.sim.workloads import SimRequest, TokenSource

_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"policy"}
_KV_FIELDS = {f.name for f in dataclasses.fields(KVPoolConfig)}


@dataclass(frozen=True)
class SimConfig:
    """The engine's own scheduler and KV-pool settings, plus the simulator's few: every engine knob is a
    simulator knob. ``SimConfig.of(...)`` takes them all as flat keywords (the CLI's and sweeps' form)."""

    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_model_len=2048))
    kv: KVPoolConfig = field(default_factory=lambda: KVPoolConfig(num_blocks=2048))
    beam_prune: float = 0.3  # beam workloads: chance per step that a candidate is replaced by a fork
    seed: int = 0
    check_invariants: bool = False  # tests: verify the KV manager's invariants after every step
    layout: KVLayout | None = None  # the model's KV groups (None: one full-attention group), as the engine's

    def __post_init__(self) -> None:
        if not 0.0 <= self.beam_prune <= 1.0:
            raise ValueError(f"beam_prune must be a probability in [0, 1], got {self.beam_prune}")

    @classmethod
    def of(cls, **settings: Any) -> SimConfig:
        """From flat keywords: SchedulerConfig's fields (``scheduling_policy`` for its policy), KVPoolConfig's,
        and the simulator's own."""
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> SimConfig:
        sched = {k: settings.pop(k) for k in list(settings) if k in _SCHEDULER_FIELDS}
        if "scheduling_policy" in settings:
            sched["policy"] = settings.pop("scheduling_policy")
        kv = {k: settings.pop(k) for k in list(settings) if k in _KV_FIELDS}
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, **sched),
                                   kv=dataclasses.replace(self.kv, **kv), **settings)

    def flat(self) -> dict[str, Any]:
        """Every setting under its flat name (reports)."""
        s = dataclasses.asdict(self.scheduler)
        s["scheduling_policy"] = s.pop("policy")
        out = {**s, **dataclasses.asdict(self.kv), "beam_prune": self.beam_prune, "seed": self.seed}
        if self.layout is not None:
            out["kv_groups"] = self.layout.describe()
        return out

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def make_kv(self) -> KVCacheManager:
        return self.kv.build(self.max_model_len, self.layout)


class Simulator:
    def __init__(self, config: SimConfig, requests: list[SimRequest], cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self.kv = config.make_kv()
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.clock = SimClock()
        self.tokens = TokenSource()
        self.worker = CostModelWorker(cost, self.clock, self.tokens, self._record_step, config.layout)
        beams = any(r.beam_width for r in requests)
        self.core = EngineCore(self.scheduler, self.worker, TokenOutputProcessor((), config.max_model_len),
                               clock=self.clock, regroup=self._reshuffle_beams if beams else None)
        self.pending = deque(sorted(requests, key=lambda r: r.arrival))
        self.rng = random.Random(config.seed)
        self.result = SimResult(config, cost.describe())
        self._requests: dict[str, tuple[SimRequest, Request]] = {}
        self._beam_fork_failures = 0
        self.recorder: FrameRecorder | None = None  # set to keep frames of the pool for an HTML replay

    # ---------------------------------------------------------------- run
    def run(self, max_steps: int = 10_000_000) -> SimResult:
        core, sched = self.core, self.scheduler
        for _ in range(max_steps):
            self._arrive()
            if not core.has_unfinished:
                if not self.pending:
                    break
                self.clock.now = max(self.clock.now, self.pending[0].arrival)
                continue
            out, touched = core.step()
            for req in touched:
                core.forget(req)
            if out.is_empty:
                if self.pending:  # nothing fits until more arrive or... nothing can free memory: wait
                    self.clock.now = max(self.clock.now, self.pending[0].arrival)
                    continue
                if not sched.has_unfinished:
                    continue
                raise RuntimeError(
                    f"simulation stalled at t={self.clock.now:.3f}s: {len(sched.waiting)} waiting, "
                    f"{len(sched.running)} running, nothing schedulable (the pool is too small for a request)"
                )
            if self.config.check_invariants:
                self.kv.check_invariants()
        else:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        r = self.result
        s = self.kv.stats()
        r.num_preemptions = sched.num_preemptions
        r.num_swap_preemptions = sched.num_swap_preemptions
        r.fork_failures = core.num_fork_failures + self._beam_fork_failures
        r.prefix_query_tokens, r.prefix_hit_tokens = s.prefix_query_tokens, s.prefix_hit_tokens
        r.cow_copies, r.evictions = s.cow_copies, s.evictions
        tiers = getattr(self.kv, "tiers", None)
        if tiers is not None:
            r.host_hit_tokens = tiers.counters.host_hit_tokens
        r.requests = [RequestRecord(spec.request_id, spec.prompt_len, spec.output_len, spec.num_samples, req.metrics,
                                    req.num_cached_tokens, req.num_generated_tokens)
                      for spec, req in self._requests.values()]
        return r

    def _arrive(self) -> None:
        while self.pending and self.pending[0].arrival <= self.clock.now:
            spec = self.pending.popleft()
            try:
                self.scheduler.check_fits(spec.prompt_len, spec.output_len)
            except ValueError as e:
                self.result.rejected.append((spec.request_id, str(e)))
                continue
            ids = self.tokens.prompt(spec)
            # no EOS id here: max_tokens ends the output either way; ignore_eos says whether the engine knew it
            params = SamplingParams(n=spec.num_samples, max_tokens=spec.output_len, ignore_eos=spec.ignore_eos,
                                    temperature=1.0)
            req = self.core.add_request(spec.request_id, None, ids, params, spec.arrival, spec.priority)
            self._requests[spec.request_id] = (spec, req)
            if spec.prefix_id is not None:
                self.result.prefix_blocks_total += spec.prefix_len // self.config.block_size

    # ------------------------------------------------------------- sample
    def _record_step(self, f: StepFeatures, seconds: float) -> None:
        sched, kv = self.scheduler, self.kv
        s = kv.stats()
        external = 0
        if len(sched.waiting):
            need = kv.reservation_blocks(sched.waiting[0])
            external = kv.stranded_free_blocks(need) * kv.block_size
        self.result.steps.append(StepSample(
            self.clock.now, seconds, len(sched.running), len(sched.waiting), len(sched.swapped), s.allocated_slots,
            s.live_tokens, s.logical_tokens, s.tail_waste_slots, s.reserved_unused_slots, external, f.num_tokens,
        ))
        if self.recorder is not None:
            self.recorder.record(kv, sched, self.clock.now)

    # --------------------------------------------------------------- beams
    def _reshuffle_beams(self, tasks: list[SampleTask]) -> list[SampleTask]:
        """Beam-like: past the first token, some candidates of a beam request lose and are replaced by a fork
        of a surviving one (which shares its blocks; the shared last block is copied on the first divergent
        write). The fork draws from its parent's row."""
        groups: dict[str, list[SampleTask]] = {}
        for t in tasks:
            groups.setdefault(t.seq.request.request_id, []).append(t)
        out: list[SampleTask] = []
        for rid, group in groups.items():
            spec, req = self._requests[rid]
            if not spec.beam_width or req.metrics.first_token_time is None:
                out += group
                continue
            losers = [t for t in group if self.rng.random() < self.config.beam_prune]
            if len(losers) == len(group):
                losers = losers[1:]
            survivors = [t for t in group if t not in losers]
            for loser in losers:
                self.scheduler.finish(loser.seq, "pruned")
                parent = self.rng.choice(survivors)
                child, ok = self.scheduler.fork(parent.targets[0], len(req.seqs))
                self.core.processor.init_seq(child)
                if ok:
                    survivors.append(SampleTask(parent.work, [child]))
                else:
                    self._beam_fork_failures += 1
            out += survivors
        return out

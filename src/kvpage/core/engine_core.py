"""The step loop that the engine and the simulator share: schedule, compute, fork n > 1 samples after the
prompt, draw, append, stop, retire, with the metrics timestamps on the way.

What computes a step is a ``StepWorker``: the model on real tensors (``kvpage.worker.Worker``) or a cost model
on a simulated clock (``kvpage.sim.cost_worker``). What a token means to the caller (text, stop strings,
logprobs) is an ``OutputProcessor``'s business. Everything in between lives here once, torch-free, so that a
simulated trace and a real run schedule, fork, preempt and finish identically.

Failures follow one rule: a failure that belongs to one request (its sampling settings, its output) fails that
request alone; a failed model step fails every request and marks the loop dead (``fatal_error``), because the
cache may hold what the failed step half wrote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from kvpage.core.beam import BeamGroup, Candidates
from kvpage.core.prompt_scores import PromptScore, record_scores
from kvpage.core.scheduler import ScheduledWork, Scheduler, SchedulerOutput
from kvpage.core.sequence import Request, Sequence, SequenceStatus
from kvpage.errors import KVCapacityError
from kvpage.outputs import RequestMetrics
from kvpage.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Finish = tuple[str, int | str | None]  # (finish_reason, stop_reason)


@dataclass
class Sample:
    """One drawn token, with what the caller asked to know about it."""

    token_id: int
    logprob: float = float("nan")  # under the raw model distribution (NaN where no logprobs were asked for)
    rank: int = 0  # 1 = the model's most likely token (0 where not computed)
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob) best first, when asked for


@dataclass
class SampleTask:
    """One row of logits (the last token of ``work``) and the sequences that each take one draw from it: the
    sequence itself, and at the end of an n > 1 prompt its forks too (independent draws from one row)."""

    work: ScheduledWork
    targets: list[Sequence]

    @property
    def seq(self) -> Sequence:
        return self.work.seq


class StepWorker(Protocol):
    """What computes a step. ``execute_model`` performs the step's block operations and its forward pass (an
    exception there is fatal); ``sample`` draws one token per target of each task, or gives a task the
    exception its own settings raised; ``beam_candidates`` gives each beam task its request's
    ``beam.keep`` best continuations (token, log-probability; blocked ids left out), best first;
    ``prompt_scores`` the step's prompt logprobs, per sequence, for the spans ``score_span`` names."""

    def execute_model(self, out: SchedulerOutput) -> Any: ...

    def sample(self, step: Any, tasks: Seq[SampleTask]) -> list[list[Sample] | BaseException]: ...

    def beam_candidates(self, step: Any, tasks: Seq[SampleTask]) -> list[Candidates | BaseException]: ...

    def prompt_scores(self, step: Any) -> dict[str, list[PromptScore]]: ...


class OutputProcessor(Protocol):
    """What a token means to the caller: ``init_seq`` gives a new or forked sequence its output state;
    ``append`` adds a drawn token to the sequence and says whether it finished it."""

    def init_seq(self, seq: Sequence) -> None: ...

    def append(self, seq: Sequence, sample: Sample) -> Finish | None: ...


def blocked_ids(seq: Sequence, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Token ids that must not be drawn now: stop ids and EOS while min_tokens is not reached, and the last token
    of any bad word the output would complete."""
    p = seq.request.params
    ids = p.banned_ids(seq.token_ids, seq.num_output_tokens) if p.bad_words_token_ids else []
    if seq.num_output_tokens < p.min_tokens:
        ids.extend(p.stop_token_ids or [])
        if not p.ignore_eos:
            ids.extend(eos_ids)
    return tuple(ids)


def token_stop(seq: Sequence, token_id: int, eos_ids: tuple[int, ...]) -> Finish | None:
    """The stops a token id decides (checked after the token was appended): EOS, then a stop token id, once
    min_tokens is reached."""
    p = seq.request.params
    if seq.num_output_tokens < p.min_tokens:
        return None
    if not p.ignore_eos and token_id in eos_ids:
        return "stop", None
    if token_id in p.stop_token_ids:
        return "stop", token_id
    return None


def length_stop(seq: Sequence, max_model_len: int) -> Finish | None:
    """max_tokens reached, or the context full."""
    m = seq.request.params.max_tokens
    if (m is not None and seq.num_output_tokens >= m) or len(seq.token_ids) >= max_model_len:
        return "length", None
    return None


class EngineCore:
    """Requests, the scheduler and one worker, stepped together.

    ``clock`` gives the metrics' timestamps (wall time for the engine, the simulated clock for the simulator).
    ``regroup``, when set, may rearrange a step's sample tasks before the draw (prune some sequences of a
    request, fork others): the seam beam-like workloads use."""

    def __init__(self, scheduler: Scheduler, worker: StepWorker, processor: OutputProcessor,
                 clock: Callable[[], float] = time.time,
                 regroup: Callable[[list[SampleTask]], list[SampleTask]] | None = None,
                 eos_ids: tuple[int, ...] = ()) -> None:
        self.scheduler = scheduler
        self.eos_ids = eos_ids  # what ends a beam (unless ignore_eos)
        self.worker = worker
        self.processor = processor
        self.clock = clock
        self.regroup = regroup
        self.requests: dict[str, Request] = {}
        self._touched: dict[str, Request] = {}  # reported by the next step (aborts, failures between steps)
        self._arrivals = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_fork_failures = 0
        self.fatal_error: str | None = None

    # --------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                    params: SamplingParams | BeamSearchParams, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> Request:
        """Queue a request the caller has checked (``Scheduler.check_fits``); its first sequence starts waiting.
        Beam search settings make it a beam group (KVCapacityError when the pool cannot hold its beams)."""
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = self._beam_group(len(prompt_ids), params)
            params = params.sampling_params()
        req = Request(request_id, prompt, prompt_ids, params, self._arrivals,
                      RequestMetrics(self.clock() if arrival_time is None else arrival_time), priority, cache_salt,
                      use_priority=self.scheduler.config.policy == "priority", beam=beam)
        self._arrivals += 1
        seq = Sequence(f"{request_id}#0", req, 0, list(prompt_ids), len(prompt_ids))
        self.processor.init_seq(seq)
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return req

    def _beam_group(self, prompt_len: int, bp: BeamSearchParams) -> BeamGroup:
        limit = self.scheduler.config.max_model_len
        room = limit - prompt_len
        max_tokens = min(bp.max_tokens or room, room)
        kv = self.scheduler.kv
        # the shared prompt plus every beam's own tail (its blocks after the prompt's last full one)
        need = kv.blocks_needed(prompt_len) + bp.beam_width * kv.blocks_needed(max_tokens + kv.block_size)
        if need > kv.num_blocks:
            raise KVCapacityError(
                f"beam search over a {prompt_len}-token prompt with beam_width={bp.beam_width} and max_tokens="
                f"{max_tokens} needs up to {need} KV blocks but the whole pool has {kv.num_blocks}: lower "
                f"beam_width or max_tokens, or enlarge the KV cache", "beam_width")
        eos = () if bp.ignore_eos else self.eos_ids
        stops = tuple(dict.fromkeys([*eos, *(bp.stop_token_ids or [])]))
        return BeamGroup(bp.beam_width, max_tokens, stops, frozenset(eos), bp.length_penalty, bp.early_stopping,
                         bp.n or bp.beam_width)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks return at once. An unknown id is ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        self._touched[request_id] = req

    def fail_request(self, req: Request, error: str, touched: dict[str, Request] | None = None) -> None:
        """End one request with an error; its blocks return at once."""
        req.error = error
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "error")
        (self._touched if touched is None else touched)[req.request_id] = req

    def fail_all(self, error: str, touched: dict[str, Request] | None = None, fatal: bool = False) -> None:
        """End every open request with ``error``; ``fatal``: the loop cannot go on and takes nothing more."""
        if fatal:
            self.fatal_error = error
        for req in list(self.requests.values()):
            if not req.finished:
                self.fail_request(req, req.error or error, touched)

    def forget(self, req: Request) -> None:
        """Drop a finished request whose last output was reported."""
        if req.finished:
            self.requests.pop(req.request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._touched)

    # ------------------------------------------------------------------- step
    def step(self, on_scheduled: Callable[[SchedulerOutput], None] | None = None,
             ) -> tuple[SchedulerOutput, list[Request]]:
        """One step: what was scheduled, and every request that changed (new tokens, finished, failed,
        aborted since the last step). ``on_scheduled`` sees the scheduler's output before anything runs."""
        out = self.scheduler.schedule()
        touched, self._touched = self._touched, {}
        if on_scheduled is not None:
            on_scheduled(out)
        if not out.is_empty:
            self.num_steps += 1
            self._run(out, touched)
        elif len(self.scheduler.waiting):
            # An empty step with requests waiting leaves the state as it was: the next would be empty too. The
            # head of the queue cannot be admitted whatever finishes (a beam group whose beams do not fit
            # together), so it fails instead of waiting forever.
            head = self.scheduler.waiting[0].request
            why = ("its beams do not fit the KV pool (or max_num_seqs) together; enlarge the KV cache, enable prefix "
                   "caching or lower beam_width") if head.beam is not None else "the KV pool cannot take it"
            self.fail_request(head, f"this request cannot be scheduled: {why}", touched)
        return out, list(touched.values())

    def _run(self, out: SchedulerOutput, touched: dict[str, Request]) -> None:
        now = self.clock()
        for w in out.work:
            if w.seq.request.metrics.first_scheduled_time is None:
                w.seq.request.metrics.first_scheduled_time = now
        try:
            step = self.worker.execute_model(out)
        except Exception as e:  # a failed step must not leak blocks or wedge the queue
            logger.exception("model step failed")
            error = f"{type(e).__name__}: {e}"
            self._fail_step(out, error, touched)
            self.fail_all(f"model step failed: {error}", touched, fatal=True)
            return
        self.scheduler.mark_computed(out)
        if any(w.seq.wants_prompt_scores for w in out.work):
            try:
                record_scores(out.work, self.worker.prompt_scores(step))
            except Exception as e:
                logger.exception("prompt logprobs failed")
                for w in out.work:
                    if w.seq.wants_prompt_scores:
                        self.fail_request(w.seq.request, f"prompt logprobs failed: {type(e).__name__}: {e}", touched)
        tasks = [self._task(w) for w in out.work if w.completes_prompt and not w.seq.finished]
        if self.regroup is not None:
            tasks = self.regroup(tasks)
        beams = [t for t in tasks if t.seq.request.beam is not None]
        if beams:
            tasks = [t for t in tasks if t.seq.request.beam is None]
            self._beam_step(step, beams, touched)
        if not tasks:
            return
        try:
            results = self.worker.sample(step, tasks)
        except Exception as e:  # even one request alone must fail alone
            results = [e] * len(tasks)
        now = self.clock()
        for task, draws in zip(tasks, results, strict=True):
            req = task.seq.request
            touched[req.request_id] = req
            if isinstance(draws, BaseException):
                logger.error("sampling for request %s failed: %r", req.request_id, draws)
                self.fail_request(req, f"sampling failed: {type(draws).__name__}: {draws}", touched)
                continue
            for seq, draw in zip(task.targets, draws, strict=True):
                if seq.finished:  # a failed fork, or an earlier failure of its request this step
                    continue
                try:
                    self._append(seq, draw, now)
                except Exception as e:
                    logger.exception("output processing for request %s failed", req.request_id)
                    self.fail_request(req, f"output processing failed: {type(e).__name__}: {e}", touched)
                    break

    def _task(self, w: ScheduledWork) -> SampleTask:
        """The sample task of a sequence whose known tokens are all computed; at the end of an n > 1 prompt
        the other samples fork here and share its blocks from then on (a fork with no room stays, finished,
        so that every sample keeps its index and its draw)."""
        seq, req = w.seq, w.seq.request
        targets = [seq]
        if req.params.n > 1 and not req.forked and req.beam is None:
            req.forked = True
            for i in range(1, req.params.n):
                child, ok = self.scheduler.fork(seq, i)
                self.processor.init_seq(child)
                if not ok:  # no room to copy (static policy only)
                    self.num_fork_failures += 1
                    req.error = "no KV room for the extra samples of n > 1 under this KV policy"
                targets.append(child)
        return SampleTask(w, targets)

    # ------------------------------------------------------------ beam search
    def _beam_step(self, step: Any, tasks: list[SampleTask], touched: dict[str, Request]) -> None:
        """Each beam offers its continuations; a group whose live beams have all offered takes its step."""
        try:
            results = self.worker.beam_candidates(step, tasks)
        except Exception as e:
            results = [e] * len(tasks)
        now = self.clock()
        for task, cands in zip(tasks, results, strict=True):
            req = task.seq.request
            touched[req.request_id] = req
            if req.finished:
                continue
            if isinstance(cands, BaseException):
                logger.error("beam candidates for request %s failed: %r", req.request_id, cands)
                self.fail_request(req, f"beam search failed: {type(cands).__name__}: {cands}", touched)
                continue
            group = req.beam
            if not group.cum:  # the prompt's end: the group's first (and only) beam
                group.start(task.seq.seq_id)
            if group.offer(task.seq.seq_id, cands):
                try:
                    self._advance_beams(req, group, now)
                except Exception as e:
                    logger.exception("beam step of request %s failed", req.request_id)
                    self.fail_request(req, f"beam search failed: {type(e).__name__}: {e}", touched)

    def _advance_beams(self, req: Request, group: BeamGroup, now: float) -> None:
        """The group's step: prune the beams without a survivor first (their blocks return before anyone
        forks), then give each parent's first survivor its sequence and fork the others off it."""
        live = {s.seq_id: s for s in req.seqs if not s.finished and s.seq_id in group.cum}
        generated = next(iter(live.values())).num_output_tokens
        survivors = group.advance({sid: s.output_token_ids for sid, s in live.items()}, generated)
        self.num_generated_tokens += len(live)
        req.num_generated_tokens += len(live)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        children: dict[str, list] = {}
        for c in survivors:
            children.setdefault(c.parent, []).append(c)
        for sid, seq in live.items():
            if sid not in children:
                self.scheduler.finish(seq, "pruned")
        if group.done:
            req.metrics.finished_time = now
            return
        req.seqs = [s for s in req.seqs if not s.finished]  # pruned beams leave the request
        for sid, kids in children.items():
            parent = live[sid]
            for c in kids[1:]:
                group.forks += 1
                child, ok = self.scheduler.fork(parent, group.forks)
                if not ok:
                    raise RuntimeError("no KV room to fork a beam under this KV policy")
                child.token_ids.append(c.token)
                group.cum[child.seq_id] = c.cum_logprob
            parent.token_ids.append(kids[0].token)
            group.cum[sid] = kids[0].cum_logprob

    def _append(self, seq: Sequence, draw: Sample, now: float) -> None:
        req = seq.request
        self.num_generated_tokens += 1
        req.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        done = self.processor.append(seq, draw)
        if done is not None:
            self.scheduler.finish(seq, *done)
            if req.finished:
                req.metrics.finished_time = now

    def _fail_step(self, out: SchedulerOutput, error: str, touched: dict[str, Request]) -> None:
        for w in out.work:
            self.fail_request(w.seq.request, error, touched)
        for seq in out.preempted:  # their swap-out copy may not have happened: rebuild by recompute
            if seq.status is SequenceStatus.SWAPPED:
                self.scheduler.requeue_for_recompute(seq)


class TokenOutputProcessor:
    """Token ids only, no text: the stops a token id or a length decides (the simulator's processor, and any
    caller that detokenizes elsewhere)."""

    def __init__(self, eos_ids: tuple[int, ...], max_model_len: int) -> None:
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def init_seq(self, seq: Sequence) -> None:
        pass

    def append(self, seq: Sequence, sample: Sample) -> Finish | None:
        seq.token_ids.append(sample.token_id)
        return token_stop(seq, sample.token_id, self.eos_ids) or length_stop(seq, self.max_model_len)

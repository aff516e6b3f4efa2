"""LLMEngine: requests in, one scheduling + model step at a time, incremental RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvpage.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpage.core.sequence import Request, Sequence, SequenceStatus
from kvpage.core.step import StepFeatures, step_log_entry
from kvpage.engine.arg_utils import EngineArgs
from kvpage.engine.output_processor import append_sample, blocked_ids, make_request_output, new_state
from kvpage.errors import EngineDeadError, InvalidRequestError, RequestIdInUseError
from kvpage.outputs import RequestMetrics, RequestOutput
from kvpage.sampling_params import SamplingParams
from kvpage.worker.model_runner import BlockOps, ScheduledSeq
from kvpage.worker.sampler import SampleRequest, argmax_suffices, sample_isolated, seeded_generator
from kvpage.worker.worker import Worker

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None) -> None:
        self.args = args = args or EngineArgs()
        torch.manual_seed(args.seed)
        self.worker = Worker(args.model_config(), args.cache_config())
        self.tokenizer = self.worker.lm.tokenizer
        # What callers may read about the model (vocabulary, architecture) without reaching into the worker.
        self.model_config = self.worker.lm.config
        self.max_model_len = self.worker.max_model_len
        self.kv = self.worker.make_kv_manager(args.kv_policy)
        batched = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill else self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=self.max_model_len, max_num_batched_tokens=batched,
                            max_num_seqs=args.max_num_seqs, enable_chunked_prefill=args.enable_chunked_prefill,
                            preemption_mode=args.preemption_mode, policy=args.scheduling_policy),
            self.kv,
        )
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending_outputs: dict[str, Request] = {}
        self.eos_ids = tuple(self.tokenizer.eos_token_ids)
        self.num_steps = 0
        self.num_generated_tokens = 0
        # Set when a step failed as a whole (the model or a bug): every request was failed, nothing more is taken.
        self.fatal_error: str | None = None
        # When a list: one entry per step (its scheduled shape and wall seconds), for calibrating the simulator.
        self.step_log: list[dict[str, float]] | None = None

    # --------------------------------------------------------------- requests
    def _prompt_ids(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, self.check_token_ids(prompt)
        raise InvalidRequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}",
                                  "prompt")

    def check_token_ids(self, ids: Seq[int], param: str = "prompt") -> list[int]:
        """``ids`` as a list, or InvalidRequestError naming the first ids outside the vocabulary."""
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab}), got {bad[:5]}", param)
        return list(ids)

    def check_request(self, prompt_len: int, max_tokens: int | None, fit_context: bool = False) -> int:
        """The checks add_request makes on lengths, for a caller that wants the answer before it builds the
        request: returns the effective max_tokens (the room left when None) or raises the RequestRejected
        subclass that says why not. ``fit_context``: max_tokens beyond max_model_len is refused, not cut."""
        return self.scheduler.check_fits(prompt_len, max_tokens, fit_context)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        """Take a request, or raise why not (a ``kvpage.errors.RequestRejected``: nothing was allocated;
        EngineDeadError once the engine has failed)."""
        if self.fatal_error is not None:
            raise EngineDeadError(self.fatal_error)
        if request_id in self.requests:
            raise RequestIdInUseError(f"request id {request_id!r} is already in use", "request_id")
        params = params or SamplingParams()
        text, ids = self._prompt_ids(prompt)
        self.check_request(len(ids), params.max_tokens)
        vocab = self.model_config.vocab_size
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = sorted({t for t in getattr(params, name) or () if t >= vocab})
            if bad:
                raise InvalidRequestError(f"{name} outside the vocabulary (size {vocab}): {bad[:5]}", name)
        req = Request(request_id, text, ids, params, next(self._arrivals),
                      RequestMetrics(arrival_time or time.time()), priority, cache_salt,
                      use_priority=self.scheduler.config.policy == "priority")
        seq = Sequence(f"{request_id}#0", req, 0, list(ids), len(ids))
        seq.state = new_state(self.tokenizer, seq, self._generator(params, 0))
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        return seeded_generator(params.seed, index)

    def abort_request(self, request_id: str | Seq[str]) -> None:
        """Stop requests wherever they are; their blocks return at once. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            req = self.requests.get(rid)
            if req is None:
                continue
            for seq in req.seqs:
                self.scheduler.finish(seq, "abort")
            self._pending_outputs[rid] = req

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending_outputs)

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that changed.

        A failure that belongs to one request (its sampling settings, its detokenization, its output) fails
        that request alone. A failed model step fails every request and leaves the engine dead
        (``fatal_error``): the cache may hold what the failed step half wrote."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        touched: dict[str, Request] = self._pending_outputs
        self._pending_outputs = {}
        features = StepFeatures.of(out) if self.step_log is not None else None  # before tokens are appended
        if not out.is_empty:
            self.num_steps += 1
            self._run(out, touched)
        results = []
        for req in touched.values():
            try:
                ro = make_request_output(req)
            except Exception as e:
                logger.exception("output of request %s failed", req.request_id)
                self._fail_request(req, f"output failed: {type(e).__name__}: {e}", {})
                ro = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [], True,
                                   req.num_cached_tokens, req.metrics, req.error)
            if ro is not None:
                results.append(ro)
            if req.finished:
                self.requests.pop(req.request_id, None)
        if features is not None and self.step_log is not None and not out.is_empty:
            self.step_log.append(step_log_entry(features, time.perf_counter() - t0))
        return results

    def _run(self, out: SchedulerOutput, touched: dict[str, Request]) -> None:
        now = time.time()
        batch = []
        blocked: dict[str, tuple[int, ...]] = {}  # per sequence that samples this step
        for w in out.work:
            req = w.seq.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            batch.append(ScheduledSeq(w.seq.seq_id, w.token_ids, w.start_pos, self.kv.block_table(w.seq.seq_id),
                                      need_logits=w.completes_prompt))
            if w.completes_prompt:
                blocked[w.seq.seq_id] = blocked_ids(w.seq, self.eos_ids)
        argmax_only = all(argmax_suffices(w.seq.request.params, blocked[w.seq.seq_id])
                          for w in out.work if w.completes_prompt)
        try:
            logits = self.worker.runner.execute(batch, BlockOps(out.swap_out, out.swap_in, out.copies),
                                                argmax_only) if batch else self._only_block_ops(out)
        except Exception as e:  # a failed step must not leak blocks or wedge the queue
            logger.exception("model step failed")
            self._fail_step(out, f"{type(e).__name__}: {e}", touched)
            self.fail_requests(f"model step failed: {type(e).__name__}: {e}", touched, fatal=True)
            return
        self.scheduler.mark_computed(out)
        rows: list[int] = []
        reqs, works = [], []
        for w in out.work:
            if w.seq.seq_id not in logits:
                continue
            seq, req = w.seq, w.seq.request
            fork = req.params.n > 1 and not req.forked
            gens = [seq.state.generator]
            if fork:
                gens += [self._generator(req.params, i) for i in range(1, req.params.n)]
            rows.append(logits.row(seq.seq_id))
            reqs.append(SampleRequest(req.params, req.prompt_token_ids, seq.output_token_ids, gens,
                                      blocked[seq.seq_id]))
            works.append(w)
        if not rows:
            return
        samples = self._sample(logits, reqs, rows)
        now = time.time()
        for w, sreq, draws in zip(works, reqs, samples, strict=True):
            seq, req = w.seq, w.seq.request
            touched[req.request_id] = req
            if seq.finished:  # an earlier sample of its request failed this step
                continue
            if isinstance(draws, Exception):
                logger.error("sampling for request %s failed: %r", req.request_id, draws)
                self._fail_request(req, f"sampling failed: {type(draws).__name__}: {draws}", touched)
                continue
            try:
                self._accept(seq, sreq, draws, now)
            except Exception as e:
                logger.exception("output processing for request %s failed", req.request_id)
                self._fail_request(req, f"output processing failed: {type(e).__name__}: {e}", touched)

    def _sample(self, logits, reqs: list[SampleRequest], rows: list[int]):
        """Draws per request, or the exception that request's settings raised (it fails alone)."""
        return sample_isolated(logits.logits, reqs, logits.argmax_rows, logits.lse_rows, rows)

    def _accept(self, seq: Sequence, sreq: SampleRequest, draws, now: float) -> None:
        req = seq.request
        if req.params.n > 1 and not req.forked:
            # The prompt was computed once; the other samples share its blocks from here on.
            req.forked = True
            for i in range(1, req.params.n):
                child, ok = self.scheduler.fork(seq, i)
                child.state = new_state(self.tokenizer, child, sreq.generators[i])
                if not ok:  # no room to copy (static policy only)
                    req.error = "no KV room for the extra samples of n > 1 under this KV policy"
                    continue
                self._append(child, draws[i], now)
        self._append(seq, draws[0], now)

    def _fail_request(self, req: Request, error: str, touched: dict[str, Request]) -> None:
        """End one request with an error; its blocks return at once."""
        req.error = error
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "error")
        touched[req.request_id] = req

    def fail_requests(self, error: str, touched: dict[str, Request] | None = None, fatal: bool = False) -> None:
        """End every open request with ``error`` (reported by the next ``step``); ``fatal``: the engine cannot
        go on and refuses new requests from now on."""
        if fatal:
            self.fatal_error = error
        pending = self._pending_outputs if touched is None else touched
        for req in list(self.requests.values()):
            if not req.finished:
                self._fail_request(req, req.error or error, pending)

    def _append(self, seq: Sequence, draw, now: float) -> None:
        req = seq.request
        self.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        done = append_sample(seq, draw, self.tokenizer, self.eos_ids, self.max_model_len)
        if done is not None:
            self.scheduler.finish(seq, *done)
            if req.finished:
                req.metrics.finished_time = now

    def _only_block_ops(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        self.worker.runner.apply_block_ops(BlockOps(out.swap_out, out.swap_in, out.copies))
        return {}

    def _fail_step(self, out: SchedulerOutput, error: str, touched: dict[str, Request]) -> None:
        for w in out.work:
            req = w.seq.request
            req.error = error
            for seq in req.seqs:
                self.scheduler.finish(seq, "error")
            touched[req.request_id] = req
        for seq in out.preempted:  # their swap-out copy may not have happened: rebuild by recompute
            if seq.status is SequenceStatus.SWAPPED:
                self.scheduler.requeue_for_recompute(seq)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        s = self.kv.stats()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
            "kv_blocks_total": s.num_blocks,
            "kv_blocks_used": s.used_blocks,
            "kv_usage": s.pool_usage,
            "kv_utilization": s.utilization,
            "prefix_cache_hit_rate": s.prefix_hit_rate,
            "prefix_cache_query_tokens": s.prefix_query_tokens,
            "prefix_cache_hit_tokens": s.prefix_hit_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "swap_preemptions": self.scheduler.num_swap_preemptions,
            "cow_copies": s.cow_copies,
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
        }

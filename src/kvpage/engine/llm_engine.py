"""LLMEngine: requests in, one scheduling + model step at a time, incremental RequestOutputs out."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvpage.core.engine_core import EngineCore
from kvpage.core.scheduler import Scheduler
from kvpage.core.sequence import Request
from kvpage.core.step import StepFeatures, step_log_entry
from kvpage.distributed.ranks import RankFailure
from kvpage.engine.arg_utils import EngineArgs
from kvpage.engine.kv_events import KVEventCallback, ZmqEventPublisher, publish
from kvpage.engine.output_processor import TextOutputProcessor, make_request_output
from kvpage.engine.structured import GrammarCompiler
from kvpage.errors import EngineDeadError, InvalidRequestError, RequestIdInUseError
from kvpage.kv.events import DevicePoolEvents, KVEventSink
from kvpage.kv.snapshot import pool_snapshot
from kvpage.outputs import RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams
from kvpage.worker.worker import Worker

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]


class LLMEngine:
    """The model behind the shared step loop (``core.engine_core.EngineCore``): prompts in, token ids checked,
    RequestOutputs out; the loop itself (schedule, forward, fork, draw, stop, retire) is the simulator's too."""

    def __init__(self, args: EngineArgs | None = None) -> None:
        self.args = args = args or EngineArgs()
        torch.manual_seed(args.seed)
        parallel = args.parallel_config()
        if parallel is not None and not parallel.leads:
            raise ValueError(f"node_rank {args.node_rank} does not host rank 0: on that host run `kvpage serve` "
                             "(or generate) with the same flags; it follows node 0")
        self.worker = Worker(args.model_config(), args.cache_config(), parallel)
        self.tokenizer = self.worker.lm.tokenizer
        # What callers may read about the model (vocabulary, architecture) without reaching into the worker.
        self.model_config = self.worker.lm.config
        self.max_model_len = self.worker.max_model_len
        self.kv = self.worker.make_kv_manager(args.kv_policy)
        self.event_sinks: list[KVEventCallback] = []
        self.events: KVEventSink | None = None
        if args.kv_events_endpoint or args.kv_events_callback is not None:
            self._open_events(args)
        self.scheduler = Scheduler(args.scheduler_config(self.max_model_len), self.kv)
        self.eos_ids = tuple(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer.to_json,
                                        max(self.model_config.vocab_size, self.tokenizer.vocab_size), self.eos_ids)
        self.core = EngineCore(self.scheduler, self.worker,
                               TextOutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len, self.grammars),
                               eos_ids=self.eos_ids)
        # When a list: one entry per step (its scheduled shape and wall seconds), for calibrating the simulator.
        self.step_log: list[dict[str, float]] | None = None

    def _open_events(self, args: EngineArgs) -> None:
        if args.kv_events_callback is not None:
            if not callable(args.kv_events_callback):
                raise ValueError("kv_events_callback must be callable (it takes a list of KV events)")
            self.event_sinks.append(args.kv_events_callback)
        if args.kv_events_endpoint:
            self.event_sinks.append(ZmqEventPublisher(args.kv_events_endpoint))
        self.events = KVEventSink(self.kv.block_size)
        self.kv.pool.listeners.append(DevicePoolEvents(self.events))
        tiers = getattr(self.kv, "tiers", None)
        if tiers is not None:
            tiers.set_events(self.events)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block in the pool and the tiers below it (vLLM's reset_prefix_cache);
        running requests keep their blocks. Returns how many entries went."""
        n = self.kv.reset_prefix_cache()
        self._publish_events()
        return n

    def pool_snapshot(self) -> dict[str, Any]:
        """The block pool as data (kv/snapshot.py) with the engine's stats: the dashboard's frame. Call it between
        steps (the server does, on the engine thread)."""
        return {"t": time.time(), "stats": self.stats(), "pool": pool_snapshot(self.kv),
                "waiting": [s.request.request_id for s in self.scheduler.waiting.items[:256]]}

    def _publish_events(self) -> None:
        if self.events is not None:
            events = self.events.drain()
            if events:
                publish(events, self.event_sinks)

    @property
    def requests(self) -> dict[str, Request]:
        return self.core.requests

    @property
    def fatal_error(self) -> str | None:
        """Set when a step failed as a whole (the model or a bug): every request was failed, nothing more is
        taken."""
        return self.core.fatal_error

    @fatal_error.setter
    def fatal_error(self, error: str | None) -> None:
        self.core.fatal_error = error

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_generated_tokens(self) -> int:
        return self.core.num_generated_tokens

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

    def add_request(self, request_id: str, prompt: PromptInput,
                    params: SamplingParams | BeamSearchParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        """Take a request, or raise why not (a ``kvpage.errors.RequestRejected``: nothing was allocated;
        EngineDeadError once the engine has failed). Beam search settings run it as a beam group."""
        if self.fatal_error is not None:
            raise EngineDeadError(self.fatal_error)
        if request_id in self.requests:
            raise RequestIdInUseError(f"request id {request_id!r} is already in use", "request_id")
        params = params or SamplingParams()
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise InvalidRequestError("two different cache_salt values for one request", "cache_salt")
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        text, ids = self._prompt_ids(prompt)
        self.check_request(len(ids), params.max_tokens)
        vocab = self.model_config.vocab_size
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = sorted({t for t in getattr(params, name, None) or () if t >= vocab})
            if bad:
                raise InvalidRequestError(f"{name} outside the vocabulary (size {vocab}): {bad[:5]}", name)
        if getattr(params, "structured_outputs", None) is not None:
            try:
                self.grammars.compile(params.structured_outputs)
            except ValueError as e:
                raise InvalidRequestError(str(e), "structured_outputs") from None
        if getattr(params, "bad_words", None):
            try:
                params.tokenize_bad_words(lambda word: self.tokenizer.encode(word, add_special_tokens=False))
            except ValueError as e:
                raise InvalidRequestError(str(e), "bad_words") from None
        self.core.add_request(request_id, text, ids, params, arrival_time, priority, cache_salt)

    def abort_request(self, request_id: str | Seq[str]) -> None:
        """Stop requests wherever they are; their blocks return at once. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self.core.abort(rid)

    def fail_requests(self, error: str, fatal: bool = False) -> None:
        """End every open request with ``error`` (reported by the next ``step``); ``fatal``: the engine cannot
        go on and refuses new requests from now on."""
        self.core.fail_all(error, fatal=fatal)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that changed.

        A failure that belongs to one request (its sampling settings, its detokenization, its output) fails
        that request alone. A failed model step fails every request and leaves the engine dead
        (``fatal_error``): the cache may hold what the failed step half wrote."""
        t0 = time.perf_counter()
        log = self.step_log
        features: list[StepFeatures] = []
        layout = self.worker.layout
        out, touched = self.core.step(None if log is None else lambda o: features.append(StepFeatures.of(o, layout)))
        results = []
        for req in touched:
            try:
                ro = make_request_output(req, self.tokenizer)
            except Exception as e:
                logger.exception("output of request %s failed", req.request_id)
                self.core.fail_request(req, f"output failed: {type(e).__name__}: {e}", {})
                ro = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [], True,
                                   req.num_cached_tokens, req.metrics, req.error)
            if ro is not None:
                results.append(ro)
            self.core.forget(req)
        if log is not None and not out.is_empty:
            log.append(step_log_entry(features[0], time.perf_counter() - t0))
        self._publish_events()
        return results

    def release_idle_memory(self) -> None:
        """Out of work (an idle server's loop, once per idle spell): every rank's freed heap back to the OS. A
        rank lost meanwhile ends the engine as check_health does."""
        try:
            self.worker.trim_heap()
        except RankFailure as e:
            self.core.fail_all(f"RankFailure: {e}", fatal=True)

    def check_health(self) -> str | None:
        """Between steps (an idle server's loop): a tensor-parallel rank lost meanwhile ends the engine now, as a
        failed step would (``fatal_error``, every open request failed), not at the next request. Returns
        ``fatal_error``."""
        if self.fatal_error is None and (why := self.worker.lost_rank()) is not None:
            self.core.fail_all(f"RankFailure: {why}", fatal=True)
        return self.fatal_error

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing on one rank), finish the disk tier's writes; idempotent."""
        self.worker.shutdown()
        for sink in self.event_sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()

    # ------------------------------------------------------------------ stats
    def live_stats(self) -> dict[str, Any]:
        """The part of ``stats()`` that costs O(1): queue lengths, blocks in use, counts of steps, tokens and
        preemptions. ``stats()`` also walks every block table and the prefix cache (0.93 ms a call with 128
        sequences running, 1.26% of their decode step on the AMX Xeon: benchmarks/dashboard.py), which a server
        need not after every step."""
        used = self.kv.num_blocks - self.kv.num_free_blocks
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": used,
            "kv_usage": used / self.kv.num_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "swap_preemptions": self.scheduler.num_swap_preemptions,
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
        }

    def stats(self) -> dict[str, Any]:
        s = self.kv.stats()
        return {
            **self.live_stats(),
            "kv_utilization": s.utilization,
            "prefix_cache_hit_rate": s.prefix_hit_rate,
            "prefix_cache_query_tokens": s.prefix_query_tokens,
            "prefix_cache_hit_tokens": s.prefix_hit_tokens,
            "kv_blocks_cached_free": s.cached_free_blocks,
            "kv_tail_waste_slots": s.tail_waste_slots,
            "kv_reserved_unused_slots": s.reserved_unused_slots,
            "kv_live_tokens": s.live_tokens,
            "kv_blocks_swapped_out": s.blocks_swapped_out,
            "kv_blocks_swapped_in": s.blocks_swapped_in,
            "cow_copies": s.cow_copies,
            "kv_blocks_shared": s.shared_blocks,
            "kv_blocks_per_request": s.used_blocks / max(1, len({seq.request.request_id
                                                                 for seq in self.scheduler.running})),
            **(tiers.stats() if (tiers := getattr(self.kv, "tiers", None)) is not None else {}),
        }

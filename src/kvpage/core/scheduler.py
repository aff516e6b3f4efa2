"""Iteration-level (continuous batching) scheduler over the paged KV manager (pure Python).

Each step: running sequences first (decodes and unfinished prompt chunks, in priority order), then, if
nothing had to be preempted, swapped sequences coming back, then waiting ones, all under a token budget
(``max_num_batched_tokens``) and ``max_num_seqs``. When the pool cannot grow a running sequence, the
lowest-priority, latest-arrived running sequence is preempted: by recompute (blocks freed, prefilled again
later with its generated tokens) or by swap (blocks moved to the host tier, brought back before it runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpage.core.admission import GrowthReserve
from kvpage.core.queue import SeqQueue
from kvpage.core.sequence import Sequence, SequenceStatus
from kvpage.errors import InvalidRequestError, KVCapacityError, PromptTooLongError
from kvpage.kv import NO_HIT, KVManager

logger = logging.getLogger(__name__)

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    policy: SchedulingPolicy = "fcfs"
    # admit only where the pool also holds the growth running sequences are certain of (core/admission.py)
    reserve_certain_growth: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass
class ScheduledWork:
    seq: Sequence
    num_tokens: int
    start_pos: int

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start_pos : self.start_pos + self.num_tokens]

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is computed: the step yields a next token."""
        return self.start_pos + self.num_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    work: list[ScheduledWork] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # the tiers below the pool (kv/offload.py): host stores ride in swap_out, host loads in swap_in
    persists: list[tuple[int, Any]] = field(default_factory=list)  # (device block, TierEntry) -> a disk file
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)  # (bytes read from disk, device block)

    @property
    def num_batched_tokens(self) -> int:
        return sum(w.num_tokens for w in self.work)

    @property
    def is_empty(self) -> bool:
        return not (self.work or self.swap_out or self.swap_in or self.copies or self.persists or self.disk_loads)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = SeqQueue()
        self.running = SeqQueue()
        self.swapped = SeqQueue()
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self._pending_copies: list[tuple[int, int]] = []  # fork copies to perform before the next step

    # ----------------------------------------------------------------- intake
    def check_fits(self, prompt_len: int, max_tokens: int | None, fit_context: bool = False) -> int:
        """Refuse a request that could never complete, instead of letting it block the queue; returns the
        effective max_tokens (for None: the room the context leaves). ``fit_context``: max_tokens beyond that
        room is an error (the OpenAI API's rule) rather than a limit the context cuts short."""
        limit = self.config.max_model_len
        if prompt_len < 1:
            raise InvalidRequestError("the prompt is empty: give at least one token", "prompt")
        if prompt_len >= limit:
            raise PromptTooLongError(prompt_len, limit)
        room = limit - prompt_len
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {max_tokens}", "max_tokens")
        if fit_context and max_tokens is not None and max_tokens > room:
            raise InvalidRequestError(f"max_tokens={max_tokens} with a prompt of {prompt_len} tokens exceeds "
                                      f"max_model_len={limit} (at most {room} here)", "max_tokens")
        longest = prompt_len + min(max_tokens or room, room)
        need = self.kv.blocks_needed(longest)  # over every KV group (a sliding window holds only its window)
        if need > self.kv.num_blocks:
            raise KVCapacityError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks but the whole "
                f"pool has {self.kv.num_blocks}: lower max_tokens or enlarge the KV cache", "max_tokens"
            )
        return room if max_tokens is None else max_tokens

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def fork(self, parent: Sequence, index: int) -> tuple[Sequence, bool]:
        """Add sample ``index`` of ``parent``'s request as a child sharing every block of ``parent``
        (called right after the parent's step, before its new token is appended). Paged: nothing is copied
        now; the first write into the shared last block copies it. A policy that cannot share (static
        reservation) copies, in the next step. The child always joins ``request.seqs``; False means there
        was no room for it and it is already finished with reason "error"."""
        req = parent.request
        child = Sequence(f"{req.request_id}#{index}", req, index, list(parent.token_ids), parent.prompt_len)
        req.seqs.append(child)
        alloc = self.kv.fork(parent, child)
        if alloc is None:
            child.status = SequenceStatus.FINISHED
            child.finish_reason = "error"
            return child, False
        self._pending_copies.extend(alloc.copies)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.add(child)
        return child, True

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        out = self._schedule()
        ops = self.kv.take_tier_ops()
        if ops:
            out.swap_out.extend(ops.stores)
            out.swap_in.extend(ops.loads)
            out.persists.extend(ops.persists)
            out.disk_loads.extend(ops.disk_loads)
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(copies=self._pending_copies)
        self._pending_copies = []
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.request.beam is not None:  # a beam group: every live beam of it at once, or none
                j = i + 1
                while j < len(running) and running[j].request is seq.request:
                    j += 1
                budget = self._schedule_group(i, j, budget, out)
                if budget < 0:
                    break  # the group itself was preempted; everything after it already was
                i = j
                continue
            want = seq.num_uncomputed
            n = min(want, budget)
            if n <= 0:
                i += 1
                continue
            if not chunked and n < want:
                break
            alloc = self.kv.allocate_slots(seq, n)
            while alloc is None and chunked and n > self.kv.block_size:
                # a smaller prompt chunk may fit where the whole one does not (a sliding-window group holds its
                # window plus the chunk while it computes): shrink before preempting anyone
                n = max(self.kv.block_size, n // 2)
                alloc = self.kv.allocate_slots(seq, n)
            while alloc is None:
                victim = running.pop()  # lowest priority, latest arrival: never one scheduled already
                self._preempt_unit(victim, i + 1, out)
                if victim is seq:
                    break
                alloc = self.kv.allocate_slots(seq, n)
            if alloc is None:
                break  # seq itself was preempted; everything after it already was
            out.copies.extend(alloc.copies)
            out.work.append(ScheduledWork(seq, n, seq.num_computed_tokens))
            budget -= n
            i += 1

        if out.preempted:
            return out  # no admissions in a step that had to preempt
        while len(self.swapped) and budget > 0 and len(running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            mapping = self.kv.swap_in(seq)
            if mapping is None:
                break
            self.swapped.pop(0)
            out.swap_in.extend(mapping)
            seq.status = SequenceStatus.RUNNING
            running.add(seq)
            n = min(seq.num_uncomputed, budget)
            if n > 0 and (chunked or n == seq.num_uncomputed):
                alloc = self.kv.allocate_slots(seq, n)
                if alloc is not None:
                    out.copies.extend(alloc.copies)
                    out.work.append(ScheduledWork(seq, n, seq.num_computed_tokens))
                    budget -= n
        reserve = GrowthReserve(self.kv, self.config.max_model_len) if self.config.reserve_certain_growth else None
        while len(self.waiting) and budget > 0 and len(running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.request.beam is not None and any(w.seq.request is seq.request for w in out.work):
                break  # one beam of a group per step: the next one finds this one's blocks in the prefix cache
            # a sequence that still owes prompt logprobs computes its whole prompt: no hit
            hit = NO_HIT if seq.wants_prompt_scores else self.kv.lookup_prefix(seq)
            want = len(seq.token_ids) - hit.num_tokens
            n = min(want, budget)
            if not chunked and n < want:
                break
            if reserve is not None and not reserve.admits(seq, hit, running.items):
                break  # it would take room running sequences will certainly need: a preemption bought ahead
            alloc = self.kv.allocate_slots(seq, n, hit)
            if alloc is None:
                break  # first come, first served: later arrivals wait behind it
            self.waiting.pop(0)
            cached = alloc.num_cached_tokens  # the hit: from the pool and the tiers below it
            seq.num_computed_tokens = cached
            if seq.request.metrics.first_scheduled_time is None and seq.index == 0:
                seq.request.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            running.add(seq)
            if reserve is not None:
                reserve.admitted(seq)
            out.work.append(ScheduledWork(seq, n, cached))
            budget -= n
        if not out.work and len(running) and len(self.waiting) and running[-1].request is not self.waiting[0].request:
            # Every running sequence is a beam waiting for siblings that cannot come in: the last group in
            # the queue gives its blocks back (by recompute), so that the first one can complete. (If that is
            # the waiting group itself, nothing can help it: the step stays empty and the engine fails it.)
            self._preempt_unit(running.pop(), 0, out)
        return out

    # ------------------------------------------------------------ beam groups
    def _schedule_group(self, i: int, j: int, budget: int, out: SchedulerOutput) -> int:
        """Work for the beam group at running[i:j]: every beam that has tokens to compute gets its slots, or
        the group leaves as a unit (preempted by recompute). Nothing is recorded until every allocation
        succeeded. Returns the budget left, or -1 if the group was preempted."""
        running, chunked = self.running, self.config.enable_chunked_prefill
        plan = []
        for m in running.items[i:j]:
            want = m.num_uncomputed
            n = min(want, budget)
            if n <= 0 or (not chunked and n < want):
                continue  # nothing to compute (it waits for its siblings), or no budget left this step
            alloc = self.kv.allocate_slots(m, n)
            while alloc is None and len(running) > j:
                self._preempt_unit(running.pop(), j, out)
                alloc = self.kv.allocate_slots(m, n)
            if alloc is None:  # the group is last: it goes, with what it took this step
                for _ in range(j - i):
                    self._preempt(running.pop(), out)
                return -1
            plan.append((m, n, alloc))
            budget -= n
        for m, n, alloc in plan:
            out.copies.extend(alloc.copies)
            out.work.append(ScheduledWork(m, n, m.num_computed_tokens))
        return budget

    def _preempt_unit(self, victim: Sequence, floor: int, out: SchedulerOutput) -> None:
        """Preempt a victim popped off the running queue; a beam takes its running siblings with it (they are
        next to it at the end of the queue, down to position ``floor``)."""
        self._preempt(victim, out)
        while victim.request.beam is not None and len(self.running) > floor \
                and self.running[-1].request is victim.request:
            self._preempt(self.running.pop(), out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1
        out.preempted.append(seq)
        # Beams go by recompute: they share blocks, which a swap would copy to the host once per beam, and the
        # group comes back as a unit through the waiting queue.
        if self.config.preemption_mode == "swap" and seq.request.beam is None:
            mapping = self.kv.swap_out(seq)
            if mapping is not None:
                out.swap_out.extend(mapping)
                seq.status = SequenceStatus.SWAPPED
                self.swapped.add(seq)
                self.num_swap_preemptions += 1
                return
            logger.info("host swap pool full: preempting %s by recompute instead", seq.seq_id)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    # ----------------------------------------------------------------- update
    def mark_computed(self, out: SchedulerOutput) -> None:
        """After the forward pass: count the computed tokens, publish newly full blocks to the prefix cache."""
        for w in out.work:
            seq = w.seq
            seq.num_computed_tokens = w.start_pos + w.num_tokens
            self.kv.cache_computed_blocks(seq, seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a sequence (finished, aborted or failed): every block it held goes back."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def requeue_for_recompute(self, seq: Sequence) -> None:
        """Forget a sequence's cached state (e.g. its swap copy may never have happened)."""
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def _release(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and return its device or host blocks."""
        for q in (self.running, self.swapped, self.waiting):
            if q.remove(seq):
                break
        if self.kv.has_seq(seq.seq_id) or self.kv.is_swapped(seq.seq_id):
            self.kv.free(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or len(self.running) or len(self.swapped))

"""Requests and their sequences, as the scheduler sees them (pure Python).

A request holds one sequence until its prompt is computed; with n > 1 it is then forked into n sequences
that share the prompt's blocks, and under beam search into its beams (core/beam.py), which fork and prune
as the search goes. Each sequence is scheduled, preempted and finished on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvpage.core.beam import BeamGroup
from kvpage.outputs import RequestMetrics
from kvpage.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no blocks: not admitted yet, or preempted by recompute
    RUNNING = "running"  # holds device blocks
    SWAPPED = "swapped"  # holds host blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request: Request
    index: int  # sample index within its request
    token_ids: list[int]  # prompt, then output; the last one may not be computed yet
    prompt_len: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # engine-side output state (detokenizer, text, logprobs); opaque to the scheduler
    state: Any = None
    # the worker's random state for this sample (a seeded generator; None until its first draw, and for
    # unseeded requests); opaque to the scheduler
    rng: Any = None
    # structured outputs: the matcher that says which tokens may come next (engine/structured.py Guide); the
    # output processor feeds it each token, the worker reads its mask; opaque to the scheduler
    guide: Any = None

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def adapter_id(self) -> str | None:
        return None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def max_total_tokens(self) -> int | None:
        """Prompt + max_tokens: the longest this sequence may grow (what an up-front reservation sizes to)."""
        m = self.request.params.max_tokens
        return None if m is None else self.prompt_len + m

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def wants_prompt_scores(self) -> bool:
        """Does this sequence still owe its request prompt logprobs? (Only the first sample computes the prompt;
        a complete record holds one score per prompt token after the first: core/prompt_scores.py.)"""
        req = self.request
        return (req.params.prompt_logprobs is not None and self.index == 0 and req.beam is None
                and not req.prompt_scored)

    @property
    def sort_key(self) -> tuple[int, int, int]:
        return (*self.request.sort_key, self.index)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    metrics: RequestMetrics
    priority: int = 0  # lower runs first (only with the priority policy)
    cache_salt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    forked: bool = False  # n > 1: children created after the prompt was computed
    num_generated_tokens: int = 0  # over all its sequences, pruned ones included
    error: str | None = None
    use_priority: bool = False
    beam: BeamGroup | None = None  # beam search: the group's state (its live beams are ``seqs`` not finished)
    # prompt_logprobs: one core.prompt_scores.PromptScore per prompt token after the first, as computed; the
    # output processor's rendering of them (opaque here) and whether a delta output carried it yet
    prompt_scores: list[Any] = field(default_factory=list)
    prompt_logprobs: Any = None
    sent_prompt_logprobs: bool = False

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority if self.use_priority else 0, self.arrival_order)

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and all(s.finished for s in self.seqs)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token after the first has its score (prompt_logprobs)."""
        return len(self.prompt_scores) >= len(self.prompt_token_ids) - 1

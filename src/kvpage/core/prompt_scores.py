"""Prompt logprobs (``SamplingParams.prompt_logprobs``): which prompt positions a step scores, and the record of
their scores on the request. Torch-free; the worker computes the scores, the output processor renders them.

Position p of a prompt of P tokens predicts token p + 1, so a complete record holds P - 1 scores (the first
token has none). A step that computes positions [s, e) of the prompt scores those in [max(s, r), min(e, P - 1)),
r being how many scores the request already holds: prompt chunks score in order, and a sequence preempted by
recompute computes its prompt again without scoring it twice.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvpage.core.scheduler import ScheduledWork


@dataclass(frozen=True)
class PromptScore:
    """One prompt token under the model's distribution at the position before it."""

    logprob: float
    rank: int  # 1 = the model's most likely token there
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), best first, as many as prompt_logprobs asked


def score_span(w: ScheduledWork) -> tuple[int, int] | None:
    """The prompt positions [first, last) this work scores, or None."""
    seq = w.seq
    if not seq.wants_prompt_scores:
        return None
    first = max(w.start_pos, len(seq.request.prompt_scores))
    last = min(w.start_pos + w.num_tokens, seq.prompt_len - 1)
    return (first, last) if first < last else None


def record_scores(work: Seq[ScheduledWork], scores: dict[str, list[PromptScore]]) -> None:
    """Append each work's scores to its request; a worker that returned the wrong number raises (the caller
    fails that request alone)."""
    for w in work:
        span = score_span(w)
        if span is None:
            continue
        got = scores.get(w.seq.seq_id)
        if got is None or len(got) != span[1] - span[0]:
            raise RuntimeError(f"{w.seq.seq_id}: expected {span[1] - span[0]} prompt scores for positions "
                               f"{span[0]}..{span[1] - 1}, got {None if got is None else len(got)}")
        w.seq.request.prompt_scores.extend(got)

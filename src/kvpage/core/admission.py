"""Admission that keeps room for growth the running sequences are certain to make (pure Python).

Paged admission hands a new sequence blocks for its prompt only; when the running ones later grow past the pool,
the latest arrival is preempted, and by recompute everything computed for it is thrown away and done again. Some of
that growth is known when a request arrives: the rest of a prompt still being prefilled in chunks, ``min_tokens``
(nothing can stop a sequence before it), and ``max_tokens`` itself when only the length can end it (``ignore_eos``
without stop strings, stop token ids or an output form). A request admitted into room that growth has already
claimed is a preemption bought in advance, so admission waits instead: the pool must hold, besides the new
sequence's own certain length, the blocks every running sequence will certainly still take. Sequences that
may stop at any token add only the next token's slot, and admission stays as it was for them.
"""

from __future__ import annotations

from kvpage.core.sequence import Sequence
from kvpage.kv import KVManager, PrefixHit


def certain_length(seq: Sequence, max_model_len: int) -> int:
    """The tokens ``seq`` will hold unless it is aborted: its prompt (and what it generated), ``min_tokens``, and
    ``max_tokens`` (the context's room when None) when nothing but the length can end it. Beams (pruned at any
    step) and outputs held to a form (complete at any token) are certain of what they have only."""
    req = seq.request
    have = len(seq.token_ids)
    if req.beam is not None or req.params.structured_outputs is not None:
        return have
    p = req.params
    out = p.min_tokens
    if p.ignore_eos and not p.stop_list and not p.stop_token_ids:
        out = p.max_tokens if p.max_tokens is not None else max_model_len
    return max(have, min(seq.prompt_len + out, max_model_len))


class GrowthReserve:
    """One step's admission check: the blocks running sequences will certainly still take (summed on first use,
    after the step's running and swapped-in sequences have their slots), grown by each admission."""

    def __init__(self, kv: KVManager, max_model_len: int) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.committed: int | None = None

    def admits(self, seq: Sequence, hit: PrefixHit, running: list[Sequence]) -> bool:
        """May ``seq`` (with prefix hit ``hit``) come in beside ``running``? Always when nothing runs: a request
        that fits the pool alone (Scheduler.check_fits) must be able to start. A hit's blocks count as held
        (an evictable one it revives is one block more than this counts)."""
        if not running:
            return True
        if self.committed is None:
            self.committed = sum(self.kv.growth_blocks(s.seq_id, certain_length(s, self.max_model_len))
                                 for s in running)
        need = self.kv.growth_blocks(seq.seq_id, certain_length(seq, self.max_model_len), hit.num_tokens)
        return self.kv.num_free_blocks - self.kv.watermark_blocks >= self.committed + need

    def admitted(self, seq: Sequence) -> None:
        """``seq`` holds its first slots now: what it still certainly takes joins the running sequences'."""
        if self.committed is not None:
            self.committed += self.kv.growth_blocks(seq.seq_id, certain_length(seq, self.max_model_len))

"""Beam search over a request's sequences, inside the step loop (pure Python, torch-free).

The beams of a request are sequences of one group. A step gives each live beam its best continuations
(token, log-probability); once every live beam of the group has them, ``BeamGroup.advance`` scores the
beam_width x (2 x beam_width) candidates by cumulative log-probability, keeps the best beam_width that do not
stop, sets aside finished hypotheses, and says which beam continues with which token. The engine loop turns
that into KV operations: the first child of a parent reuses its sequence, the others fork it (sharing every
block; the shared partial last block is copied on the first write), and parents with no child are freed in
the same step.

The selection follows transformers' beam search (generation/utils.py ``_beam_search``, 5.x): the top
max(2, 1 + stop ids) x beam_width candidates, finished hypotheses only from the first beam_width of them,
scored cum_logprob / generated_len ** length_penalty, at most beam_width kept; the early-stop heuristic for
``early_stopping`` False / True / "never". Beams that have their candidates wait (nothing left to compute)
while a preempted sibling catches up, so preemption never changes the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Candidates = list[tuple[int, float]]  # (token id, log-probability), best first


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token included) and scores."""

    token_ids: tuple[int, ...]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id, for a stop_token_ids hit


@dataclass(frozen=True)
class Continuation:
    """One surviving candidate: beam ``parent`` (a sequence id) goes on with ``token``."""

    parent: str
    token: int
    cum_logprob: float


@dataclass
class BeamGroup:
    """The beam state of one request."""

    width: int
    max_tokens: int  # generated tokens at which every candidate stops (the context limit folded in)
    stop_ids: tuple[int, ...]  # tokens that finish a hypothesis (EOS unless ignored, stop_token_ids)
    eos_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    n: int = 0  # hypotheses returned (0: width)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    cum: dict[str, float] = field(default_factory=dict)  # live beam -> cumulative log-probability
    pending: dict[str, Candidates] = field(default_factory=dict)  # this length's candidates, per live beam
    improvable: bool = True  # transformers' early-stop heuristic: can a running beam still beat the finished?
    done: bool = False
    forks: int = 0  # sequences forked so far (the next fork's index: sequence ids stay unique)

    @property
    def keep(self) -> int:
        """Candidates gathered per step (enough that width beams survive whichever stop)."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    def start(self, seq_id: str) -> None:
        self.cum = {seq_id: 0.0}

    def offer(self, seq_id: str, candidates: Candidates) -> bool:
        """One live beam's continuations at the current length; True once every live beam has given its."""
        if seq_id in self.cum:
            self.pending[seq_id] = candidates
        return len(self.pending) == len(self.cum)

    def advance(self, tokens_of: dict[str, list[int]], num_generated: int) -> list[Continuation]:
        """One beam step over the pending candidates. ``tokens_of``: each live beam's output tokens so far;
        ``num_generated``: how many each has (the same for all). Returns the next live beams (best first); empty
        when the search is over (``done``)."""
        flat = [(self.cum[sid] + lp, sid, tok) for sid, cands in self.pending.items() for tok, lp in cands]
        flat.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then the candidate's rank
        top = flat[: self.keep]
        new_len = num_generated + 1
        at_length = new_len >= self.max_tokens
        running: list[Continuation] = []
        new_finished: list[Hypothesis] = []
        full_before = len(self.finished) >= self.width
        for rank, (score, sid, tok) in enumerate(top):
            stops = tok in self.stop_ids
            if not stops and not at_length:
                if len(running) < self.width:
                    running.append(Continuation(sid, tok, score))
                continue
            if rank >= self.width or not self.improvable or (full_before and self.early_stopping is True):
                continue  # only the first width candidates may finish (transformers' top_num_beam_mask)
            reason, stop_reason = ("stop", None if tok in self.eos_ids else tok) if stops else ("length", None)
            new_finished.append(Hypothesis((*tokens_of[sid], tok), score, score / new_len ** self.length_penalty,
                                           reason, stop_reason))
        merged = self.finished + new_finished
        merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses first on ties, as topk over the merge
        self.finished = merged[: self.width]
        self.pending = {}
        self.cum = {}
        if running:
            self._update_improvable(running[0].cum_logprob, new_len)
        if (not running or not self.improvable
                or (self.early_stopping is True and len(self.finished) >= self.width)):
            self.done = True
            return []
        return running

    def _update_improvable(self, best_running: float, new_len: int) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens
        else:
            length = new_len
        best = best_running / length ** self.length_penalty
        if len(self.finished) >= self.width:
            self.improvable = self.improvable and best > min(h.score for h in self.finished)

    def results(self) -> list[Hypothesis]:
        """The best n finished hypotheses, best first."""
        return self.finished[: self.n or self.width]

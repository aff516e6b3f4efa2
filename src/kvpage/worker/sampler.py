"""Next-token choice from logits: penalties, min_tokens, temperature, top-k / top-p / min-p, seeded draws,
and logprobs of the raw model distribution."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """One row of logits and everything needed to draw ``num_samples`` tokens from it."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generators: Sequence[torch.Generator | None]  # one per sample (independent draws for n > 1 forks)
    blocked_ids: Sequence[int] = ()  # EOS / stop ids masked while min_tokens is not reached


@dataclass
class Sample:
    token_id: int
    logprob: float  # under the raw model distribution
    rank: int  # 1 = the model's most likely token
    top_logprobs: list[tuple[int, float]] | None  # (token, logprob) best first, when asked for


def seeded_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Per-sample generator: a seeded request reproduces; its samples differ from each other."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index) % (2**63))
    return g


def _apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int],
                     output_ids: Sequence[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if t < vocab}), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor([t for t in output_ids if t < vocab], dtype=torch.long),
                                minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p at -inf."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def plain_greedy(params: SamplingParams, blocked_ids: Sequence[int] = ()) -> bool:
    """The model's argmax is the answer: greedy, no penalties, nothing masked."""
    return params.greedy and not params.uses_penalties and not blocked_ids


def argmax_suffices(params: SamplingParams, blocked_ids: Sequence[int] = ()) -> bool:
    """Plain greedy and no logprobs asked: the step needs each row's argmax, not its logits."""
    return plain_greedy(params, blocked_ids) and params.logprobs is None


def sample(logits: torch.Tensor | None, requests: Sequence[SampleRequest], argmax: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, rows: Sequence[int] | None = None) -> list[list[Sample]]:
    """Samples for each request from its row of float32 ``logits`` (row i, or ``rows[i]``).

    With each row's precomputed ``argmax`` and log-sum-exp ``lse`` (indexed like ``logits``), plain greedy
    rows (no penalties, nothing blocked) take no further pass over the vocabulary. ``logits`` may be None
    when every request is plain greedy without logprobs (``argmax_suffices``): the argmax is the sample and
    its logprob is not computed (NaN; it is reported nowhere for such requests).
    """
    rows = list(range(len(requests))) if rows is None else list(rows)
    if logits is None:
        if argmax is None or not all(argmax_suffices(r.params, r.blocked_ids) for r in requests):
            raise ValueError("without logits every request must be plain greedy with no logprobs")
        amax = argmax.tolist()
        return [[Sample(amax[row], float("nan"), 1, None)] * len(req.generators)
                for row, req in zip(rows, requests, strict=True)]
    if len(rows) != len(requests) or (rows and max(rows) >= logits.shape[0]):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} sample requests")
    results: list[list[Sample]] = []
    amax = argmax.tolist() if argmax is not None else None
    lses = lse.tolist() if lse is not None else None
    for row, req in zip(rows, requests, strict=True):
        p = req.params
        if amax is not None and lses is not None and plain_greedy(p, req.blocked_ids):
            t = amax[row]
            lp_t = float(logits[row, t]) - lses[row]
            top = None
            if p.logprobs:
                values, ids = torch.topk(logits[row], p.logprobs)
                top = [(i, v - lses[row]) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
            results.append([Sample(t, lp_t, 1, top)] * len(req.generators))
            continue
        x = logits[row].clone()
        if p.uses_penalties:
            x = _apply_penalties(x, p, req.prompt_ids, req.output_ids)
        if req.blocked_ids:
            x[torch.tensor(list(req.blocked_ids), dtype=torch.long)] = float("-inf")
        draws: list[int] = []
        if p.greedy:
            draws = [int(torch.argmax(x))] * len(req.generators)
        else:
            probs = torch.softmax(_filter(x, p), dim=-1)
            for g in req.generators:
                draws.append(int(torch.multinomial(probs, 1, generator=g)))
        lp = torch.log_softmax(logits[row], dim=-1)
        top = None
        if p.logprobs:
            values, ids = torch.topk(lp, p.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        results.append([Sample(t, float(lp[t]), int((lp > lp[t]).sum()) + 1, top) for t in draws])
    return results

"""Next-token choice for a whole step at once: penalties, logit bias, allowed and blocked ids, temperature,
top-k / top-p / min-p and seeded draws as batched tensor operations over every sampling row, and logprobs of
the raw model distribution for the requests that ask for them.

Degenerate settings behave as the limits they approach, never as NaN: a temperature below ``SAMPLING_EPS`` is
greedy, a top-p or min-p that rounds to zero in float32 keeps the most likely token, and logits that a
penalty pushes past float32's range are clamped to it. ``sample_isolated`` reruns a failing step request by
request, so one request's bad settings fail that request alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvpage.core.engine_core import Sample
from kvpage.sampling_params import SAMPLING_EPS, SamplingParams
from kvpage.worker.token_masks import allowed_words, words_bias

if TYPE_CHECKING:
    from kvpage.ops import Kernels

_NEG_INF = float("-inf")
_F32_MAX = torch.finfo(torch.float32).max
_AUTO = object()  # sample(ops=...): the compiled kernels if they are built


def _kernels() -> Kernels | None:
    from kvpage.ops import kernels

    return kernels()


@dataclass
class SampleRequest:
    """One row of logits and everything needed to draw ``len(generators)`` tokens from it."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generators: Sequence[torch.Generator | None]  # one per sample (independent draws for n > 1 forks)
    blocked_ids: Sequence[int] = ()  # masked this step: EOS / stop ids before min_tokens, bad words' last tokens
    guide: Any = None  # structured outputs: the sequence's matcher (next_masks(guides): what may come next)
    _uniforms: list[float] | None = None
    guide_mask: np.ndarray | None = None  # this step's mask from ``guide`` (token_masks.guide_words), once

    def uniforms(self) -> list[float]:
        """This step's uniform per sample, drawn once: a retry after a failed batch draws the same tokens."""
        if self._uniforms is None:
            shared = torch.rand(len(self.generators), dtype=torch.float64)
            self._uniforms = [float(torch.rand(1, generator=g, dtype=torch.float64)) if g is not None
                              else float(shared[j]) for j, g in enumerate(self.generators)]
        return self._uniforms


def seeded_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Per-sample generator: a seeded request reproduces whatever else is in the batch; its samples differ."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index) % (2**63))
    return g


def plain_greedy(params: SamplingParams, blocked_ids: Sequence[int] = ()) -> bool:
    """The model's argmax is the answer: greedy, nothing that reshapes the logits, nothing masked."""
    return params.greedy and not params.shapes_logits and not blocked_ids


def argmax_suffices(params: SamplingParams, blocked_ids: Sequence[int] = ()) -> bool:
    """Plain greedy and no logprobs asked: the step needs each row's argmax, not its logits."""
    return plain_greedy(params, blocked_ids) and params.logprobs is None


def sample(logits: torch.Tensor | None, requests: Sequence[SampleRequest], argmax: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, rows: Sequence[int] | None = None,
           ops: Kernels | object | None = _AUTO) -> list[list[Sample]]:
    """Samples for each request from its row of float32 ``logits`` (row i, or ``rows[i]``).

    With each row's precomputed ``argmax`` and log-sum-exp ``lse`` (indexed like ``logits``), plain greedy
    rows take no further pass over the vocabulary. ``logits`` may be None when every request is plain greedy
    without logprobs (``argmax_suffices``): the argmax is the sample and its logprob is not computed.
    Draws run in the compiled kernel (``ops.sample_rows``) when it is built, else in torch; ``ops=None``
    forces torch (the tests compare the two).
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
    results: list[list[Sample] | None] = [None] * len(requests)
    fast = argmax is not None and lse is not None
    slow = [i for i, r in enumerate(requests) if not (fast and plain_greedy(r.params, r.blocked_ids))]
    if fast:
        slow_set = set(slow)
        _greedy_rows(logits, requests, rows, argmax, lse, [i for i in range(len(requests)) if i not in slow_set],
                     results)
    if slow:
        _drawn_rows(logits, [requests[i] for i in slow], [rows[i] for i in slow], slow, results,
                    _kernels() if ops is _AUTO else ops)
    return results  # type: ignore[return-value]


def sample_isolated(logits: torch.Tensor | None, requests: Sequence[SampleRequest],
                    argmax: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    rows: Sequence[int] | None = None, ops: Kernels | object | None = _AUTO,
                    ) -> list[list[Sample] | Exception]:
    """``sample`` for the whole step; if it raises, each request alone, so that only those that fail on their
    own get their exception back (the others keep their draws)."""
    try:
        return list(sample(logits, requests, argmax, lse, rows, ops))
    except Exception:
        if len(requests) == 1:
            raise
    rows = list(range(len(requests))) if rows is None else list(rows)
    out: list[list[Sample] | Exception] = []
    for req, row in zip(requests, rows, strict=True):
        try:
            out.append(sample(logits, [req], argmax, lse, [row], ops)[0])
        except Exception as e:
            out.append(e)
    return out


# ---------------------------------------------------------------------------------------------- internals
def _greedy_rows(logits: torch.Tensor, requests: Sequence[SampleRequest], rows: Sequence[int],
                 argmax: torch.Tensor, lse: torch.Tensor, which: list[int], results: list) -> None:
    """Plain greedy rows: the precomputed argmax, its logprob from the log-sum-exp, top-N only if asked."""
    if not which:
        return
    amax, lses = argmax.tolist(), lse.tolist()
    picked = logits[torch.tensor([rows[i] for i in which]), torch.tensor([amax[rows[i]] for i in which])].tolist()
    for i, value in zip(which, picked, strict=True):
        req, row = requests[i], rows[i]
        top = None
        if req.params.logprobs:
            values, ids = torch.topk(logits[row], req.params.logprobs)
            top = [(t, v - lses[row]) for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
        results[i] = [Sample(amax[row], value - lses[row], 1, top)] * len(req.generators)


def _flat_ids(lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated ids and their [len + 1] offsets."""
    lengths = [len(ids) for ids in lists]
    offsets = torch.zeros(len(lists) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(0)
    flat = torch.tensor([t for ids in lists for t in ids], dtype=torch.long)
    return flat, offsets


def _penalize(x: torch.Tensor, requests: Sequence[SampleRequest], which: list[int], ops: Kernels | None) -> None:
    """Repetition, presence and frequency penalties on rows ``which`` of ``x``, in place."""
    vocab = x.shape[1]
    if ops is not None:
        params = [requests[i].params for i in which]
        prompt, prompt_off = _flat_ids([requests[i].prompt_ids if p.repetition_penalty != 1.0 else ()
                                        for i, p in zip(which, params, strict=True)])
        output, output_off = _flat_ids([requests[i].output_ids for i in which])
        ops.apply_penalties_(x, torch.tensor(which, dtype=torch.long), prompt, prompt_off, output, output_off,
                             torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
                             torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
                             torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32))
        return
    for i in which:
        req, p = requests[i], requests[i].params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor([*req.prompt_ids, *req.output_ids], dtype=torch.long)
            seen = seen[(seen >= 0) & (seen < vocab)]
            if seen.numel():
                mask = torch.zeros(vocab, dtype=torch.bool)
                mask[seen] = True
                row = x[i]
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                x[i] = torch.where(mask, penalized, row)
        if (p.presence_penalty or p.frequency_penalty) and req.output_ids:
            out = torch.tensor(list(req.output_ids), dtype=torch.long)
            counts = torch.bincount(out[(out >= 0) & (out < vocab)], minlength=vocab).to(x.dtype)
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def _shape_logits(x: torch.Tensor, requests: Sequence[SampleRequest], ops: Kernels | None = None) -> None:
    """In place: penalties, logit bias, allowed ids and blocked ids, row by row only where a request asks."""
    vocab = x.shape[1]
    penalized = [i for i, r in enumerate(requests) if r.params.uses_penalties]
    if penalized:
        _penalize(x, requests, penalized, ops)
    for i, req in enumerate(requests):
        p = req.params
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
            x[i].index_add_(0, ids, torch.tensor([p.logit_bias[t] for t in ids.tolist()], dtype=x.dtype))
    # structured outputs and allowed ids: the tokens each row may draw, as the logits pass takes them
    masked = [i for i, r in enumerate(requests) if r.guide is not None or r.params.allowed_token_ids is not None]
    if masked:
        bias = words_bias(np.stack(allowed_words([requests[i] for i in masked], vocab)), vocab)
        if len(masked) == x.shape[0]:
            x.add_(bias)  # (every row masked, the usual case with structured outputs: no gather and scatter)
        else:
            idx = torch.tensor(masked, dtype=torch.long)
            x.index_copy_(0, idx, x.index_select(0, idx).add_(bias))
    # A penalty may have pushed values past float32's range (or made inf - inf): clamp, NaN never survives.
    torch.nan_to_num_(x, nan=_NEG_INF, posinf=_F32_MAX, neginf=_NEG_INF)
    for i, req in enumerate(requests):
        if req.blocked_ids:
            blocked = torch.tensor(list(req.blocked_ids), dtype=torch.long)
            x[i, blocked[blocked < vocab]] = _NEG_INF


def _filter_rows(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place, on temperature-scaled logits: everything outside top-k / top-p / min-p goes to -inf. The most
    likely token always stays, so a filter that rounds to nothing keeps one candidate."""
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks)
        kmax = int(k.max())
        kth = torch.topk(x, kmax, dim=1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth[k == 0] = _NEG_INF
        x.masked_fill_(x < kth, _NEG_INF)
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        idx = torch.tensor(p_rows)
        sub = x.index_select(0, idx)
        ordered, order = torch.sort(sub, dim=1, descending=True)
        probs = torch.softmax(ordered, dim=1)
        top_p = torch.tensor([params[i].top_p for i in p_rows], dtype=x.dtype)[:, None]
        drop = (probs.cumsum(1) - probs) >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop[:, 0] = False
        x.index_copy_(0, idx, sub.scatter(1, order, ordered.masked_fill(drop, _NEG_INF)))
    m_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if m_rows:
        idx = torch.tensor(m_rows)
        sub = x.index_select(0, idx)
        probs = torch.softmax(sub, dim=1)
        min_p = torch.tensor([params[i].min_p for i in m_rows], dtype=x.dtype)[:, None]
        cut = probs < min_p * probs.max(dim=1, keepdim=True).values
        cut.scatter_(1, probs.argmax(dim=1, keepdim=True), False)
        x.index_copy_(0, idx, sub.masked_fill(cut, _NEG_INF))


def step_uniforms(requests: Sequence[SampleRequest], width: int) -> torch.Tensor:
    """[rows, width] float64 uniforms in [0, 1): a seeded sample draws from its own generator, one value per
    step, so its tokens do not depend on the rest of the batch; unseeded samples from the global generator,
    in one draw for the whole batch."""
    fresh = [r for r in requests if r._uniforms is None and not any(g is not None for g in r.generators)]
    if fresh:
        shared = torch.rand(sum(len(r.generators) for r in fresh), dtype=torch.float64).tolist()
        at = 0
        for r in fresh:
            r._uniforms, at = shared[at : at + len(r.generators)], at + len(r.generators)
    return torch.tensor([(u := r.uniforms()) + u[-1:] * (width - len(u)) for r in requests], dtype=torch.float64)


def _draw(source: torch.Tensor, idx: list[int], requests: Sequence[SampleRequest], width: int,
          ops: Kernels | None) -> torch.Tensor:
    """[len(idx), width] draws from rows ``idx`` of ``source`` (temperature > 0 on each)."""
    params = [r.params for r in requests]
    u = step_uniforms(requests, width)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    if ops is not None and source.dtype == torch.float32 and source.is_contiguous():
        vocab = source.shape[1]
        return ops.sample_rows(source, torch.tensor(idx, dtype=torch.long), temps,
                               torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
                               torch.tensor([p.top_p for p in params], dtype=torch.float32),
                               torch.tensor([p.min_p for p in params], dtype=torch.float32), u)
    xs = source.index_select(0, torch.tensor(idx, dtype=torch.long)) / temps[:, None]
    torch.nan_to_num_(xs, nan=_NEG_INF, posinf=_F32_MAX, neginf=_NEG_INF)
    _filter_rows(xs, params)
    cdf = torch.softmax(xs, dim=1).double().cumsum_(dim=1)
    total = cdf[:, -1:]
    # inverse CDF; the target stays below the total, so the pick is a token of nonzero probability
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.contiguous(), right=True).clamp_(max=source.shape[1] - 1)


def _drawn_rows(logits: torch.Tensor, requests: Sequence[SampleRequest], rows: Sequence[int], slots: list[int],
                results: list, ops: Kernels | None) -> None:
    """Every request that is not plain greedy. Rows whose logits nothing reshapes are drawn from the step's
    logits in place; the others from a copy with their penalties, bias and masks applied."""
    width = max(len(r.generators) for r in requests)
    tokens = torch.zeros(len(requests), width, dtype=torch.long)
    shaped_ix = [i for i, r in enumerate(requests) if r.params.shapes_logits or r.blocked_ids]
    shaped_pos = {i: j for j, i in enumerate(shaped_ix)}
    greedy = [r.params.greedy for r in requests]
    shaped = None
    if shaped_ix:
        shaped = logits.index_select(0, torch.tensor([rows[i] for i in shaped_ix], dtype=torch.long))
        _shape_logits(shaped, [requests[i] for i in shaped_ix], ops)
        # A row with every candidate masked (allowed ids all blocked, say) falls back to the model's argmax.
        empty = (shaped.max(dim=1).values == _NEG_INF).tolist()
        for j, i in enumerate(shaped_ix):
            if empty[j]:
                shaped[j] = logits[rows[i]]
                greedy[i] = True
    for i, g in enumerate(greedy):
        if g:
            tokens[i] = int((shaped[shaped_pos[i]] if i in shaped_pos else logits[rows[i]]).argmax())
    plain = [i for i, g in enumerate(greedy) if not g and i not in shaped_pos]
    if plain:
        tokens[torch.tensor(plain)] = _draw(logits, [rows[i] for i in plain], [requests[i] for i in plain], width, ops)
    reshaped = [i for i, g in enumerate(greedy) if not g and i in shaped_pos]
    if reshaped and shaped is not None:
        tokens[torch.tensor(reshaped)] = _draw(shaped, [shaped_pos[i] for i in reshaped],
                                               [requests[i] for i in reshaped], width, ops)
    want_lp = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    lp_rows: dict[int, torch.Tensor] = {}
    if want_lp:
        lps = torch.log_softmax(logits.index_select(0, torch.tensor([rows[i] for i in want_lp])), dim=1)
        lp_rows = {i: lps[j] for j, i in enumerate(want_lp)}
    toks = tokens.tolist()
    for i, req in enumerate(requests):
        n = len(req.generators)
        if i not in lp_rows:
            results[slots[i]] = [Sample(t, float("nan"), 0, None) for t in toks[i][:n]]
            continue
        lp = lp_rows[i]
        top = None
        if req.params.logprobs:
            values, ids = torch.topk(lp, req.params.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        chosen = torch.tensor(toks[i][:n])
        chosen_lp = lp[chosen]
        ranks = (lp[None, :] > chosen_lp[:, None]).sum(dim=1) + 1
        results[slots[i]] = [Sample(t, v, r, top) for t, v, r in
                             zip(toks[i][:n], chosen_lp.tolist(), ranks.tolist(), strict=True)]


def beam_candidates(logits: torch.Tensor, rows: Sequence[int], temperatures: Sequence[float],
                    banned: Sequence[Sequence[int]], keep: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Per row: the ``keep`` most likely tokens and their log-probabilities (float32 log-softmax of the row,
    divided by its temperature where that is > 0 and not 1), best first; ``banned`` ids never appear."""
    x = logits[list(rows)].float()
    scale = torch.tensor([1.0 if t < SAMPLING_EPS else t for t in temperatures], dtype=torch.float32)
    if bool((scale != 1.0).any()):
        x = x / scale[:, None]
    lp = torch.log_softmax(x, dim=-1)
    for i, ids in enumerate(banned):
        if ids:
            lp[i, list(ids)] = -math.inf
    k = min(max(keep), lp.shape[1])
    values, ids = lp.topk(k, dim=-1)
    out = []
    for i, n in enumerate(keep):
        vals, toks = values[i, :n].tolist(), ids[i, :n].tolist()
        out.append([(t, v) for t, v in zip(toks, vals, strict=True) if v != -math.inf])
    return out

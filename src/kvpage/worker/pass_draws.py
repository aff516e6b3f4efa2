"""Draws that the logits pass makes itself (model/logits.py RowDraws, ops.logits_draw): when no request of a step
needs its row of logits, each row's token is drawn while the row is still in cache, and a step of 128 rows of
SmolLM2 skips writing and reading back 25 MB of float32 logits.

Rows whose only change to the logits is which tokens may come next (structured outputs, ``allowed_token_ids``,
the ids blocked before ``min_tokens``, bad words) go this way too, with a bit mask of their allowed tokens: the
same float32 row, the same -inf entries and the same draw as the sampler's path from the logits, so the same
tokens. Penalties and ``logit_bias`` change values, and logprobs need the row: those steps take the logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpage.core.engine_core import Sample
from kvpage.sampling_params import SamplingParams
from kvpage.worker.sampler import SampleRequest, plain_greedy, step_uniforms
from kvpage.worker.token_masks import allowed_words


@dataclass(frozen=True)
class DrawSetting:
    """One row's draw for the logits pass: temperature 0 takes the argmax (of the allowed tokens, with a
    mask)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    uniforms: tuple[float, ...]
    mask: np.ndarray | None = field(default=None, compare=False)  # [words] int32: the tokens this row may draw


def mask_only(params: SamplingParams) -> bool:
    """Nothing changes the row's values: at most which tokens may come next does."""
    return not (params.uses_penalties or params.logit_bias)


def logits_pass_draws(requests: Sequence[SampleRequest], vocab: int) -> list[DrawSetting] | None:
    """Each request's draw for the logits pass, when none of the step's requests needs its row of logits: one
    sample each, no logprobs, nothing that changes a row's values; None otherwise (and when every row is plain
    greedy: the argmax-only pass serves those). The uniforms are drawn here as ``sample`` draws them, and kept
    on the requests (as the guides' masks are), so a head that returns logits instead draws the same tokens."""
    for r in requests:
        if r.params.logprobs is not None or len(r.generators) != 1 or not mask_only(r.params):
            return None
    if all(plain_greedy(r.params, r.blocked_ids) for r in requests):
        return None
    masks = allowed_words(requests, vocab)
    drawn = [r for r in requests if not r.params.greedy]
    us = iter(step_uniforms(drawn, 1)[:, 0].tolist() if drawn else [])
    out = []
    for r, mask in zip(requests, masks, strict=True):
        p = r.params
        out.append(DrawSetting(0.0, 0, 1.0, 0.0, (0.0,), mask) if p.greedy else
                   DrawSetting(p.temperature, p.top_k, p.top_p, p.min_p, (next(us),), mask))
    return out


def row_draws_tensors(settings: Sequence[DrawSetting]) -> dict[str, torch.Tensor | None]:
    """RowDraws' fields for settings in row order: the masks stacked, each row pointing at its own (-1: none)."""
    masked = [s.mask for s in settings if s.mask is not None]
    mask_of = None
    if masked:
        at = itertools.count()
        mask_of = torch.tensor([next(at) if s.mask is not None else -1 for s in settings], dtype=torch.long)
    return {"temperature": torch.tensor([s.temperature for s in settings], dtype=torch.float32),
            "top_k": torch.tensor([s.top_k for s in settings], dtype=torch.long),
            "top_p": torch.tensor([s.top_p for s in settings], dtype=torch.float32),
            "min_p": torch.tensor([s.min_p for s in settings], dtype=torch.float32),
            "uniforms": torch.tensor([s.uniforms for s in settings], dtype=torch.float64),
            "mask_of": mask_of,
            "masks": torch.from_numpy(np.stack(masked)) if masked else None}


def drawn_samples(tokens: torch.Tensor, requests: Sequence[SampleRequest], rows: Sequence[int]) -> list[list[Sample]]:
    """The samples of a step whose logits pass drew the tokens (logits_pass_draws): no logprobs were asked."""
    toks = tokens[:, 0].tolist()
    return [[Sample(toks[row], float("nan"), 1 if plain_greedy(r.params, r.blocked_ids) else 0, None)]
            for r, row in zip(requests, rows, strict=True)]

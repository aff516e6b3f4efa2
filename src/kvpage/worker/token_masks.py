"""Which tokens a row may draw this step, as int32 bit words (bit j of word i: token 32 i + j): a structured
output's guide mask, narrowed to ``allowed_token_ids``, less the blocked ids. One definition for both ways a step
draws: the logits pass takes the words as they are (pass_draws.py, ops logits_draw), the sampler's path from the
logits adds them as a 0 / -inf bias (sampler.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvpage.worker.sampler import SampleRequest


def guide_words(requests: Sequence[SampleRequest]) -> np.ndarray:
    """[rows, words] int32: each guided request's mask of what may come next, the masks still missing computed
    in one batch and kept on the requests (a step whose logits pass could not draw masks its logits with
    the same words)."""
    todo = [r for r in requests if r.guide_mask is None]
    if todo:
        for r, words in zip(todo, todo[0].guide.next_masks([r.guide for r in todo]), strict=True):
            r.guide_mask = words
    return np.stack([r.guide_mask for r in requests])


def allowed_words(requests: Sequence[SampleRequest], vocab: int) -> list[np.ndarray | None]:
    """Per request, [ceil(vocab / 32)] int32 words of the tokens it may draw this step (bit j of word i: token
    32 i + j), or None when it may draw any: its guide's mask (computed for all guided rows at once), narrowed
    to ``allowed_token_ids``, without its blocked ids. Ids at or past ``vocab`` are never allowed. Word by word
    (a row unpacked to one flag per token and packed again cost ~27 us, 1.7 ms a step at 64 guided rows)."""
    n = (vocab + 31) // 32
    guided = [r for r in requests if r.guide is not None]
    if guided:
        guide_words(guided)
    out: list[np.ndarray | None] = []
    for r in requests:
        allowed = r.params.allowed_token_ids
        if r.guide is None and allowed is None and not r.blocked_ids:
            out.append(None)
            continue
        words = np.zeros(n, dtype=np.uint32)
        if r.guide is None:
            words[:] = 0xFFFFFFFF
        else:
            g = r.guide_mask.view(np.uint32)[:n]
            words[: g.size] = g
        if vocab % 32:
            words[-1] &= np.uint32((1 << (vocab % 32)) - 1)
        if allowed is not None:
            only = np.zeros(n, dtype=np.uint32)
            at = np.asarray(allowed, dtype=np.int64)
            at = at[at < vocab]
            np.bitwise_or.at(only, at >> 5, np.left_shift(np.uint32(1), (at & 31).astype(np.uint32)))
            words &= only
        for t in r.blocked_ids:  # a few ids (stop ids before min_tokens, bad words' last tokens)
            if 0 <= t < vocab:
                words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
        out.append(words.view(np.int32))
    return out


def words_bias(words: np.ndarray, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 from int32 bit words (bit j of word i: token 32 i + j may come next): 0
    where a token may come, -inf where not (ids past the words too). Added to the logits, not masked in: a
    masked fill over a patchy mask branches on every value (~5x the time at 64 x 49k)."""
    keep = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if keep.shape[1] < vocab:
        keep = np.pad(keep, ((0, 0), (0, vocab - keep.shape[1])))
    return torch.from_numpy(keep).to(torch.float32).sub_(1.0).mul_(3.0e38).mul_(10.0)  # -1 overflows to -inf

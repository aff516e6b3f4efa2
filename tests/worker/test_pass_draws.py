"""What the logits pass is asked to draw (worker/pass_draws.py): which steps qualify, and each row's allowed-token
bits against the masks the sampler applies to logits."""

from __future__ import annotations

import numpy as np
import torch

from kvpage.sampling_params import SamplingParams
from kvpage.worker.pass_draws import logits_pass_draws, row_draws_tensors
from kvpage.worker.sampler import SampleRequest
from kvpage.worker.token_masks import allowed_words, words_bias

VOCAB = 200  # not a multiple of 32: the last word's high bits are past the vocabulary


class FixedGuide:
    """A guide whose mask is given (what llguidance's matcher would compute), counting its calls."""

    def __init__(self, allowed: list[int], words: int) -> None:
        keep = np.zeros(words * 32, dtype=bool)
        keep[allowed] = True
        self.words = np.packbits(keep, bitorder="little").view(np.int32)
        self.calls = 0

    def next_masks(self, guides):
        self.calls += 1
        return np.stack([g.words for g in guides])


def req(params: SamplingParams, blocked=(), guide=None) -> SampleRequest:
    return SampleRequest(params, [1, 2], [], [None], list(blocked), guide)


def bits(words: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist())


def test_allowed_words_combine_guide_allowed_ids_and_blocked_ids():
    g = FixedGuide([0, 5, 31, 32, 150, 199], words=7)
    reqs = [req(SamplingParams()), req(SamplingParams(), blocked=[5, 199, 500]), req(SamplingParams(), guide=g),
            req(SamplingParams(allowed_token_ids=[5, 31, 150, 250]), blocked=[31], guide=g)]
    words = allowed_words(reqs, VOCAB)
    assert words[0] is None
    assert bits(words[1]) == set(range(VOCAB)) - {5, 199}
    assert bits(words[2]) == {0, 5, 31, 32, 150, 199}
    assert bits(words[3]) == {5, 150}
    assert all(w.dtype == np.int32 and w.shape == (7,) for w in words[1:])
    assert g.calls == 1  # every guided row at once; then kept on the requests
    allowed_words(reqs, VOCAB)
    assert g.calls == 1
    # the same tokens as the bias the sampler adds to a row of logits
    bias = words_bias(np.stack([words[2]]), VOCAB)[0]
    assert set(torch.nonzero(bias == 0).flatten().tolist()) == bits(words[2])


def test_which_steps_the_pass_draws():
    plain, greedy = SamplingParams(seed=1), SamplingParams(temperature=0)
    g = FixedGuide([7], words=7)
    assert logits_pass_draws([req(greedy), req(greedy)], VOCAB) is None  # the argmax-only pass serves those
    for other in (SamplingParams(logprobs=1), SamplingParams(presence_penalty=0.5), SamplingParams(logit_bias={3: 1})):
        assert logits_pass_draws([req(plain), req(other)], VOCAB) is None
    settings = logits_pass_draws([req(greedy, guide=g), req(plain), req(greedy, blocked=[2]),
                                  req(SamplingParams(allowed_token_ids=[4]))], VOCAB)
    assert settings is not None
    assert [s.temperature for s in settings] == [0.0, 1.0, 0.0, 1.0]
    assert [s.mask is not None for s in settings] == [True, False, True, True]
    t = row_draws_tensors(settings)
    assert t["mask_of"].tolist() == [0, -1, 1, 2] and t["masks"].shape == (3, 7)
    assert bits(t["masks"][2].numpy()) == {4}
    assert row_draws_tensors(settings[1:2])["mask_of"] is None


def test_rows_with_several_samples_take_the_logits():
    r = SampleRequest(SamplingParams(n=2, seed=3), [1], [], [None] * 2)
    assert logits_pass_draws([r], VOCAB) is None

"""SamplingParams validation and the sampler's filters on synthetic logits."""

from __future__ import annotations

import pytest
import torch

from kvpage.sampling_params import SamplingParams
from kvpage.worker.sampler import SampleRequest, sample, seeded_generator


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be an integer >= 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be -1, 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"min_tokens": 5, "max_tokens": 2}, "must not exceed max_tokens"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
        ({"stop": ["ok", ""]}, "stop must be non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be token ids"),
        ({"output_kind": "sometimes"}, "output_kind must be"),
    ],
)
def test_invalid_values_name_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.repetition_penalty) == (
        1, 1.0, 1.0, 0, 0.0, 16, 1.0)
    assert SamplingParams(stop="x").stop_list == ["x"]


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0]])


def draw(params: SamplingParams, times: int = 200, output_ids=(), prompt_ids=(), blocked=()) -> set[int]:
    g = seeded_generator(5, 0)
    req = SampleRequest(params, prompt_ids, output_ids, [g] * times, blocked)
    return {s.token_id for s in sample(LOGITS.clone(), [req])[0]}


def test_filters_restrict_the_candidates():
    assert draw(SamplingParams(temperature=0)) == {0}
    assert draw(SamplingParams(top_k=2)) <= {0, 1} and len(draw(SamplingParams(top_k=2))) == 2
    assert draw(SamplingParams(top_p=0.3)) == {0}
    assert draw(SamplingParams(min_p=0.5)) == {0, 1}  # p1/p0 = e^-0.5 = 0.61 >= 0.5; p2/p0 = 0.37 < 0.5
    assert draw(SamplingParams()) == {0, 1, 2, 3, 4}


def test_penalties_and_blocked_ids():
    assert draw(SamplingParams(temperature=0, repetition_penalty=2.0), output_ids=[0]) == {1}
    assert draw(SamplingParams(temperature=0, presence_penalty=1.0), output_ids=[0]) == {1}
    assert draw(SamplingParams(temperature=0, frequency_penalty=0.3), output_ids=[0, 0]) == {1}
    assert draw(SamplingParams(temperature=0), blocked=[0, 1]) == {2}


def test_seeded_draws_reproduce_and_logprobs_are_raw():
    p = SamplingParams(temperature=1.0, logprobs=2)
    a = sample(LOGITS.clone(), [SampleRequest(p, (), (), [seeded_generator(9, 0) for _ in range(1)])])
    b = sample(LOGITS.clone(), [SampleRequest(p, (), (), [seeded_generator(9, 0) for _ in range(1)])])
    assert a[0][0].token_id == b[0][0].token_id
    raw = torch.log_softmax(LOGITS[0], -1)
    s = a[0][0]
    assert s.logprob == pytest.approx(float(raw[s.token_id]))
    assert [t for t, _ in s.top_logprobs] == [0, 1] and s.rank == int((raw > raw[s.token_id]).sum()) + 1
    different = {sample(LOGITS.clone(), [SampleRequest(p, (), (), [seeded_generator(9, i)])])[0][0].token_id
                 for i in range(12)}
    assert len(different) > 1


def test_argmax_only_steps_need_plain_greedy_requests():
    greedy = SampleRequest(SamplingParams(temperature=0), [1], [], [None, None])
    out = sample(None, [greedy], argmax=torch.tensor([7, 3]), rows=[1])
    assert [s.token_id for s in out[0]] == [3, 3] and out[0][0].rank == 1
    for bad in (SampleRequest(SamplingParams(temperature=0, logprobs=1), [1], [], [None]),
                SampleRequest(SamplingParams(temperature=0.8), [1], [], [None]),
                SampleRequest(SamplingParams(temperature=0), [1], [], [None], blocked_ids=[2])):
        with pytest.raises(ValueError, match="plain greedy"):
            sample(None, [bad], argmax=torch.tensor([0]))

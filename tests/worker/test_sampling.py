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


def draw(params: SamplingParams, times: int = 200, output_ids=(), prompt_ids=(), blocked=(), ops=None) -> set[int]:
    """Tokens drawn on both paths (torch, and the compiled kernel when built); they must agree as sets."""
    from kvpage.ops import load_kernels

    found = []
    for path in ({None, load_kernels()} if ops is None else {ops}):
        g = seeded_generator(5, 0)
        req = SampleRequest(params, prompt_ids, output_ids, [g] * times, blocked)
        found.append({s.token_id for s in sample(LOGITS.clone(), [req], ops=path)[0]})
    assert all(f == found[0] for f in found), found
    return found[0]


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


# ------------------------------------------------------------------ degenerate settings and isolation
def test_degenerate_settings_are_the_limits_they_approach():
    assert draw(SamplingParams(temperature=1e-300)) == {0}  # too small to divide by: greedy
    assert draw(SamplingParams(temperature=1e-6)) == {0}
    assert draw(SamplingParams(top_p=1e-300)) == {0}  # rounds to 0 in float32: the top token stays
    assert draw(SamplingParams(min_p=1e-300)) == {0, 1, 2, 3, 4}
    assert draw(SamplingParams(top_k=1, top_p=1e-45, min_p=1.0)) == {0}
    # a tiny repetition penalty divides a seen positive logit into overflow: clamped, the seen token wins
    assert draw(SamplingParams(repetition_penalty=1e-300), output_ids=[1]) == {1}
    assert draw(SamplingParams(temperature=0, repetition_penalty=1e-300), output_ids=[1]) == {1}
    # a huge one sends every seen negative logit to -inf; the unseen tokens remain
    assert draw(SamplingParams(repetition_penalty=1e300), output_ids=[0, 1, 2, 4]) <= {0, 1, 2, 3}
    assert draw(SamplingParams(temperature=1e30)) == {0, 1, 2, 3, 4}  # flat


def test_logit_bias_and_allowed_ids():
    assert draw(SamplingParams(temperature=0, logit_bias={4: 100.0})) == {4}
    assert draw(SamplingParams(logit_bias={0: -100.0, 1: -100.0})) <= {2, 3, 4}
    assert draw(SamplingParams(allowed_token_ids=[2, 3])) == {2, 3}
    assert draw(SamplingParams(temperature=0, allowed_token_ids=[3, 4])) == {3}
    # every allowed token blocked: the model's own argmax rather than NaN
    assert draw(SamplingParams(allowed_token_ids=[4]), blocked=[4]) == {0}
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("inf"))
    with pytest.raises(ValueError, match="top_p must be a finite number"):
        SamplingParams(top_p=float("nan"))


def test_bad_words_mask_the_token_that_would_complete_them():
    vocab = {"ab": [1, 2], " ab": [3, 2], "c": [4], " c": [4], "x": [5, 6, 7], " x": [5, 6, 7]}
    p = SamplingParams(bad_words=["ab", " c", "ab", "x"])
    assert p.bad_words == ["ab", " c", "x"]  # duplicates dropped
    p.tokenize_bad_words(vocab.__getitem__)
    assert p.bad_words_token_ids == [[1, 2], [3, 2], [4], [5, 6, 7]]  # each spelling once
    prompt = [9, 1]  # a word's earlier tokens count in the output only
    assert p.banned_ids(prompt, 0) == [4]
    assert p.banned_ids([*prompt, 1], 1) == [2, 4]
    assert p.banned_ids([*prompt, 8, 3], 2) == [2, 4]
    assert p.banned_ids([*prompt, 5, 6], 2) == [4, 7]
    assert p.banned_ids([*prompt, 6], 1) == [4]
    for bad in ([""], ["  "], [3], [f"w{i}" for i in range(257)]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="tokenizes to nothing"):
        SamplingParams(bad_words=["zz"]).tokenize_bad_words(lambda text: [])


def test_one_bad_request_fails_alone_and_seeds_ignore_the_batch():
    import copy

    from kvpage.worker.sampler import sample_isolated

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.9, top_k=20, seed=5)

    def req(params, index=0):
        return SampleRequest(params, (1, 2), (3,), [seeded_generator(params.seed, index)])

    alone = sample(logits, [req(p)], rows=[2])[0][0].token_id
    bad = copy.copy(SamplingParams(top_p=0.5))
    bad.top_k = "x"  # type: ignore[assignment]  # what no validation lets through
    out = sample_isolated(logits, [req(SamplingParams(temperature=0)), req(bad), req(p),
                                   req(SamplingParams(min_p=0.1, presence_penalty=1.0))], rows=[0, 1, 2, 3])
    assert isinstance(out[1], TypeError)
    assert out[0][0].token_id == int(logits[0].argmax())
    assert out[2][0].token_id == alone  # the same seed draws the same token whatever shares the step
    assert isinstance(out[3][0].token_id, int)
    def many():  # fresh generators each time
        return [req(SamplingParams(temperature=1.3, top_p=0.95, seed=s)) for s in range(20)]

    batched = [r[0].token_id for r in sample(logits, many(), rows=[i % 4 for i in range(20)])]
    single = [sample(logits, [r], rows=[i % 4])[0][0].token_id for i, r in enumerate(many())]
    assert batched == single


# ------------------------------------------------------------------ distributions against the definitions
VOCAB_LOGITS = torch.tensor([[3.0, 2.2, 2.0, 1.1, 0.5, 0.0, -0.7, -2.0]])


def reference(params: SamplingParams, prompt=(), output=()) -> list[float]:
    """The textbook definitions, written out in plain Python."""
    import math

    x = VOCAB_LOGITS[0].tolist()
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * list(output).count(t) + params.presence_penalty
    x = [v / params.temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order[: params.top_k] if params.top_k > 0 else order)

    def softmax(ids):
        m = max(x[i] for i in ids)
        z = sum(math.exp(x[i] - m) for i in ids)
        return {i: math.exp(x[i] - m) / z for i in ids}

    probs = softmax(keep)
    if params.top_p < 1:
        mass, kept = 0.0, set()
        for i in sorted(keep, key=lambda i: -probs[i]):
            kept.add(i)
            mass += probs[i]
            if mass >= params.top_p:
                break
        keep, probs = kept, softmax(kept)
    if params.min_p > 0:
        top = max(probs.values())
        keep = {i for i in keep if probs[i] >= params.min_p * top}
        probs = softmax(keep)
    return [probs.get(i, 0.0) for i in range(len(x))]


def sampler_paths():
    """The compiled kernel (when this machine builds it) and the torch path."""
    from kvpage.ops import load_kernels

    ops = load_kernels()
    return [pytest.param(ops, id="kernel", marks=pytest.mark.skipif(ops is None, reason="no compiled kernels")),
            pytest.param(None, id="torch")]


@pytest.mark.parametrize("ops", sampler_paths())
@pytest.mark.parametrize(("params", "prompt", "output"), [
    (SamplingParams(temperature=1.0), (), ()),
    (SamplingParams(temperature=0.6), (), ()),
    (SamplingParams(temperature=1.7), (), ()),
    (SamplingParams(top_k=3), (), ()),
    (SamplingParams(top_p=0.8), (), ()),
    (SamplingParams(temperature=1.4, top_p=0.6), (), ()),
    (SamplingParams(min_p=0.2), (), ()),
    (SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.05), (), ()),
    (SamplingParams(repetition_penalty=1.8), (0, 5), (6,)),
    (SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), (), (0, 0, 1, 3)),
])
def test_draws_follow_the_reference_distribution(params, prompt, output, ops):
    n = 6000
    req = SampleRequest(params, prompt, output, [seeded_generator(17, 0)] * n)
    counts = torch.bincount(torch.tensor([s.token_id for s in sample(VOCAB_LOGITS.clone(), [req], ops=ops)[0]]),
                            minlength=8).double() / n
    expect = torch.tensor(reference(params, prompt, output), dtype=torch.float64)
    assert torch.all(counts[expect == 0] == 0), (counts, expect)
    # 4.5 standard deviations of a binomial frequency, per token
    tol = 4.5 * torch.sqrt(expect * (1 - expect) / n) + 1e-3
    assert torch.all((counts - expect).abs() <= tol), (counts, expect)


def test_compiled_penalties_equal_the_torch_ones():
    from kvpage.ops import load_kernels
    from kvpage.worker.sampler import _shape_logits

    ops = load_kernels()
    if ops is None:
        pytest.skip("no compiled kernels")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g) * 4
    reqs = [SampleRequest(SamplingParams(repetition_penalty=1.3), [1, 2, 2, 299, 7], [7, 7, 8], [None]),
            SampleRequest(SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4), [5], [3, 3, 3, 9], [None]),
            SampleRequest(SamplingParams(repetition_penalty=0.6, presence_penalty=-1.5, frequency_penalty=2.0),
                          list(range(0, 300, 3)), [4, 4, 299, 0], [None]),
            SampleRequest(SamplingParams(), [1], [1], [None]),
            SampleRequest(SamplingParams(repetition_penalty=1e-30), [10, 11], [], [None])]
    a, b = logits.clone(), logits.clone()
    _shape_logits(a, reqs, ops)
    _shape_logits(b, reqs, None)
    assert torch.equal(a, b)

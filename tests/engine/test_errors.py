"""Typed engine errors: each refusal is its own class (a ValueError, so older callers still catch it), names
the input at fault, allocates nothing; the server maps the classes to HTTP codes in one place."""

from __future__ import annotations

import pytest

from kvpage.core.scheduler import Scheduler, SchedulerConfig
from kvpage.errors import (
    EngineDeadError,
    InvalidRequestError,
    KVCapacityError,
    PromptTooLongError,
    QueueFullError,
    RequestIdInUseError,
    RequestRejected,
    ShuttingDownError,
)
from kvpage.kv import make_kv_manager


def scheduler(num_blocks: int = 8, block_size: int = 16, max_model_len: int = 256) -> Scheduler:
    kv = make_kv_manager("paged", num_blocks, block_size, max_model_len=max_model_len)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len), kv)


@pytest.mark.parametrize(("prompt_len", "max_tokens", "fit", "cls", "param"), [
    (0, 4, False, InvalidRequestError, "prompt"),
    (256, 4, False, PromptTooLongError, "prompt"),
    (300, None, False, PromptTooLongError, "prompt"),
    (10, 0, False, InvalidRequestError, "max_tokens"),
    (10, 250, True, InvalidRequestError, "max_tokens"),
    (120, 100, False, KVCapacityError, "max_tokens"),  # 220 tokens need 14 blocks of 16; the pool has 8
])
def test_scheduler_refusals_are_typed_and_name_the_input(prompt_len, max_tokens, fit, cls, param):
    s = scheduler()
    with pytest.raises(cls) as e:
        s.check_fits(prompt_len, max_tokens, fit)
    assert isinstance(e.value, RequestRejected) and isinstance(e.value, ValueError)
    assert e.value.param == param
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_scheduler_returns_the_effective_max_tokens():
    s = scheduler(num_blocks=64)
    assert s.check_fits(10, None) == 246  # the room the context leaves
    assert s.check_fits(10, 5) == 5
    assert s.check_fits(10, 500) == 500  # not fit_context: the context cuts it short later
    with pytest.raises(PromptTooLongError) as e:
        s.check_fits(256, 1)
    assert (e.value.prompt_len, e.value.max_model_len) == (256, 256)


def test_engine_refusals_are_typed_and_leave_nothing_behind():
    from kvpage.engine.llm import LLM

    llm = LLM(kv_cache_memory="64MiB", max_model_len=128, dtype="float32")
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    cases = [
        ("a", [], None, InvalidRequestError, "prompt"),
        ("b", [1] * 128, None, PromptTooLongError, "prompt"),
        ("c", [1, vocab], None, InvalidRequestError, "prompt"),
        ("d", [1, True], None, InvalidRequestError, "prompt"),
        ("e", {"neither": 1}, None, InvalidRequestError, "prompt"),
    ]
    from kvpage.sampling_params import SamplingParams

    cases.append(("f", [1, 2], SamplingParams(stop_token_ids=[vocab + 3]), InvalidRequestError, "stop_token_ids"))
    for rid, prompt, params, cls, param in cases:
        with pytest.raises(cls) as e:
            eng.add_request(rid, prompt, params)
        assert e.value.param == param, rid
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(RequestIdInUseError) as e:
        eng.add_request("ok", [4, 5], SamplingParams(max_tokens=1))
    assert e.value.param == "request_id"
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng.requests
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    eng.fatal_error = "boom"
    with pytest.raises(EngineDeadError, match="boom"):
        eng.add_request("late", [1, 2])


def test_the_server_maps_each_error_class_to_one_http_code():
    pytest.importorskip("fastapi")
    from kvpage.entrypoints.openai.protocol import APIError
    from kvpage.entrypoints.openai.serving import api_error

    cases = [
        (PromptTooLongError(300, 256), 400, "context_length_exceeded"),
        (RequestIdInUseError("in use", "request_id"), 409, None),
        (InvalidRequestError("bad", "max_tokens"), 400, None),
        (KVCapacityError("too big", "max_tokens"), 400, None),
        (QueueFullError("full"), 429, None),
        (ShuttingDownError("draining"), 503, None),
        (EngineDeadError("dead"), 503, None),
        (ValueError("temperature must be >= 0"), 400, None),
        (RuntimeError("bug"), 500, None),
    ]
    for err, status, code in cases:
        mapped = api_error(err)
        assert mapped.status == status, err
        body = mapped.body()["error"]
        if code is not None:
            assert body["code"] == code
        if isinstance(err, RequestRejected):
            assert body["param"] == err.param
    full = api_error(QueueFullError("full"))
    assert full.headers and full.headers.get("Retry-After")
    same = APIError(418, "teapot")
    assert api_error(same) is same


def test_a_request_whose_draw_fails_alone_in_its_step_fails_alone():
    """The batched sampler reruns a failing step request by request, but with one request in the step there
    is nothing to isolate: that request fails, the engine lives on and takes the next request."""
    from kvpage.engine.llm import LLM
    from kvpage.sampling_params import SamplingParams

    llm = LLM(kv_cache_memory="64MiB", max_model_len=128, dtype="float32")
    eng = llm.engine
    real = eng.worker.sample_requests

    def broken(logits, reqs, rows):
        raise RuntimeError("injected sampler failure")

    eng.worker.sample_requests = broken  # this engine instance only
    eng.add_request("alone", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=4))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished and "injected sampler failure" in (outs[-1].error or "")
    assert eng.fatal_error is None and eng.kv.num_free_blocks == eng.kv.num_blocks
    eng.worker.sample_requests = real
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3

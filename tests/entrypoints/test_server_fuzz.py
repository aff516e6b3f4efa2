"""Request bodies drawn from the OpenAI schema, with valid, extreme and invalid values, against a live server:
never a 5xx, never a hang, a stream always ends in [DONE], and no block stays in use afterwards."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers.server_util import KEY, metric, request, server, wait_idle

pytest.importorskip("fastapi")

MAX_LEN = 96


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with server("--api-key", KEY, "--max-model-len", str(MAX_LEN), "--max-n", "3", "--http-timeout", "5") as p:
        yield p


odd_text = st.sampled_from(["", " ", "\ud800", "a\udfffb", "\x00", "\u202e", "🙂" * 3, "<|im_end|>", "\\u0000",
                            "é" * 50, "\n" * 20])
text = st.one_of(st.text(max_size=40), odd_text)
junk = st.one_of(st.none(), st.booleans(), text, st.sampled_from([float("nan"), float("inf"), -1, 0, 10**30, 1.5]),
                 st.lists(st.integers(), max_size=2), st.dictionaries(text, text, max_size=2))
token_id = st.integers(0, 49151)
some_ids = st.lists(token_id, min_size=1, max_size=5)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}, {"function": {"name": "g"}}]


def field(valid: st.SearchStrategy, extreme: list | None = None) -> st.SearchStrategy:
    """Mostly valid values (7 in 10), then the range's extremes (2 in 10), then anything at all."""
    edge = st.sampled_from(extreme) if extreme else valid
    return st.integers(0, 9).flatmap(lambda i: valid if i < 7 else edge if i < 9 else junk)


TINY = [5e-324, 1e-300, 1e-45, 1e-38, 1e-6, 1e-5]
SAMPLING = {
    "model": field(st.sampled_from(["SmolLM2-135M-Instruct", None]), ["gpt-4", ""]),
    "n": field(st.integers(1, 3), [0, 4, -1]),
    "max_tokens": field(st.integers(1, 12), [None, 1, MAX_LEN, 0, -1, 10**6, 2**63]),
    "temperature": field(st.floats(0, 2), [*TINY, 0.0, 1e38, 1e300, -1e-300]),
    "top_p": field(st.floats(1e-3, 1), [*TINY, 1.0, 0.0, 1.0000001]),
    "top_k": field(st.integers(-1, 100), [1, 2**31, 2**63, 49152, -2]),
    "min_p": field(st.floats(0, 1), [*TINY, 1.0, 1.0000001]),
    "seed": field(st.integers(-(2**63), 2**64), [0, -1, 2**64 - 1]),
    "presence_penalty": field(st.floats(-2, 2), [-2.0, 2.0, *TINY, 2.5]),
    "frequency_penalty": field(st.floats(-2, 2), [-2.0, 2.0, *TINY, -2.5]),
    "repetition_penalty": field(st.floats(0.05, 3), [*TINY, 1e300, 1e38, 0.0]),
    "stop": field(st.one_of(text, st.lists(text, max_size=3)), ["e", " ", "\ud800"]),
    "stop_token_ids": field(st.lists(token_id, max_size=3), [[2], [-1], [10**6]]),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(0, 8), [MAX_LEN, -1]),
    "skip_special_tokens": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "cache_salt": field(text),
    "stream": st.booleans(),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                "continuous_usage_stats": st.booleans()})),
    "logit_bias": field(st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3),
                        [{"2": 100}, {"0": -100}, {"49151": 100.0}, {"1": 100.5}, {"-1": 1}, {"x": 1}]),
    "allowed_token_ids": field(some_ids, [[2], [], [49152]]),
    "truncate_prompt_tokens": field(st.integers(1, MAX_LEN), [-1, 0, 2**63]),
    "response_format": field(st.sampled_from([{"type": "text"}, None]), [{"type": "json_object"}]),
    "tools": field(st.sampled_from([None, TOOLS]), [[], [{"type": "function"}], [{"function": {"parameters": 1}}],
                                                    [{"type": "function", "function": {"name": "f", "parameters": {
                                                        "type": "nothing"}}}]]),
    "use_beam_search": field(st.booleans()),
    "length_penalty": field(st.floats(-2, 2), [1e300, -1e300]),
    "early_stopping": field(st.sampled_from([True, False, "never"]), ["soon", 2]),
}


def body(required: dict[str, st.SearchStrategy], extra: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """The required fields and up to four others."""
    if not extra:
        return st.fixed_dictionaries(required)
    keys = st.lists(st.sampled_from(sorted(extra)), max_size=4, unique=True)
    return st.tuples(st.fixed_dictionaries(required), keys.flatmap(
        lambda ks: st.fixed_dictionaries({k: extra[k] for k in ks}))).map(lambda t: {**t[0], **t[1]})


prompt = field(st.one_of(text, st.lists(token_id, min_size=1, max_size=30), st.lists(text, min_size=1, max_size=3)),
               [[], [[]], [-1], [10**6], "x" * 2000, [[1, 2], "mixed"]])
call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "user", "tool"]),
                                 "content": field(text, [None, [{"type": "text", "text": "hi"}],
                                                         [{"type": "image_url", "image_url": {"url": "x"}}]])},
                                optional={"tool_calls": field(st.just([call]), [[{"function": {"name": "f",
                                                                                               "arguments": "{"}}],
                                                                                 "x", [1]]),
                                          "tool_call_id": field(text)})
messages = field(st.lists(message, min_size=1, max_size=3), [[], [{"role": "wizard", "content": "x"}]])
completion = body({"prompt": prompt}, {**SAMPLING, "logprobs": field(st.integers(0, 20), [21, -1]),
                                       "echo": field(st.booleans()),
                                       "prompt_logprobs": field(st.integers(0, 20), [21, -1, "x"]),
                                       "best_of": field(st.integers(1, 4), [0, 5, -1])})
chat = body({"messages": messages}, {
    **SAMPLING, "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(0, 20), [21]),
    "max_completion_tokens": field(st.integers(1, 12), [0, 10**6]),
    "prompt_logprobs": field(st.integers(0, 3), [21]),
    "add_generation_prompt": field(st.booleans()), "chat_template_kwargs": field(st.dictionaries(text, text)),
    "tool_choice": field(st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
                         [{"function": {"name": "nope"}}, {"type": "function"}, "sometimes"]),
    "parallel_tool_calls": field(st.booleans())})
tokenize = st.one_of(body({"prompt": text}, {"add_special_tokens": field(st.booleans())}),
                     body({"messages": messages}, {"add_generation_prompt": field(st.booleans())}))
detokenize = body({"tokens": field(st.lists(token_id, max_size=20), [[-1], [10**6], []])}, {})
item = st.one_of(message, st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": text,
                                                 "arguments": field(st.just('{"x": 1}'), ["{", "[]"])}),
                 st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text,
                                        "output": field(text, [[{"type": "input_text", "text": "x"}], 5])}),
                 st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "input_image", "message"])}))
flat_tools = [{"type": "function", "name": "f", "parameters": TOOLS[0]["function"]["parameters"]}]
responses = body({"input": field(st.one_of(text, st.lists(item, min_size=1, max_size=3)), [[], "", [[]]])}, {
    **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "seed", "stream", "stop", "model")},
    "instructions": field(text), "max_output_tokens": field(st.integers(1, 12), [0, -1, 10**6]),
    "tools": field(st.just(flat_tools), [[{"type": "web_search"}], [{"type": "function"}], "x"]),
    "tool_choice": field(st.sampled_from(["none", "required", {"type": "function", "name": "f"}]),
                         [{"type": "function", "name": "nope"}, "auto"]),
    "text": field(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
                  [{"format": {"type": "json_schema"}}, {"format": "x"}, {"format": {"type": "yaml"}}]),
    "previous_response_id": field(st.none(), ["resp_1"]), "store": field(st.booleans()),
    "background": field(st.just(False), [True]), "include": field(st.just(["message.output_text.logprobs"]), [["x"]]),
    "top_logprobs": field(st.integers(0, 5), [21, -1]), "truncation": field(st.just("disabled"), ["auto", "x"]),
    "metadata": field(st.dictionaries(text, text, max_size=2)),
    "conversation": field(st.none(), ["conv_1", {"id": 5}, 5, {}])})
conversation = body({}, {"items": field(st.lists(item, max_size=3), ["x", [5], [{"role": "wizard", "content": "x"}]]),
                         "metadata": field(st.dictionaries(text, text, max_size=2),
                                           [{"k": 1}, "x", {str(i): "v" for i in range(17)}])})
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": st.just("f"),
                           "input": field(st.just({"x": 1}), ["x", None])}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text,
                           "content": field(text, [[{"type": "image"}], 5])}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking"])}))
turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "user", "system"]),
                              "content": field(st.one_of(text, st.lists(block, max_size=3)), [None, 5, []])})
anthropic = body({"messages": field(st.lists(turn, min_size=1, max_size=3), [[], "x"]),
                  "max_tokens": field(st.integers(1, 12), [0, -1, 10**6, "x"])}, {
    **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "stream", "model")},
    "system": field(text, [[{"type": "image"}], 5]), "stop_sequences": field(st.lists(text, max_size=2), ["x", [1]]),
    "tools": field(st.just([{"name": "f", "input_schema": TOOLS[0]["function"]["parameters"]}]),
                   [[{"type": "web_search_20250305", "name": "w"}], [{"description": "x"}], "x"]),
    "tool_choice": field(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"},
                                          {"type": "none"}]),
                         [{"type": "tool", "name": "nope"}, {"type": "x"}, "auto"]),
    "thinking": field(st.just({"type": "disabled"}), [{"type": "enabled", "budget_tokens": 10}])})
calls = st.one_of(st.tuples(st.just("/v1/completions"), completion), st.tuples(st.just("/v1/chat/completions"), chat),
                  st.tuples(st.just("/v1/responses"), responses), st.tuples(st.just("/v1/messages"), anthropic),
                  st.tuples(st.just("/tokenize"), tokenize), st.tuples(st.just("/detokenize"), detokenize),
                  st.tuples(st.just("/v1/conversations"), conversation))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=calls)
def test_no_body_gets_a_5xx_or_hangs(port, call):
    path, body = call
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # a hang fails the test by timing out
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    raw = resp.read().decode("utf-8", "replace")
    conn.close()
    event(f"{path} {resp.status}")
    assert resp.status < 500, (resp.status, raw[:500], body)
    if resp.status != 200:
        assert "error" in json.loads(raw), raw
    elif resp.getheader("content-type", "").startswith("text/event-stream") and path == "/v1/messages":
        assert raw.rstrip().rsplit("event: ", 1)[-1].startswith("message_stop"), raw[-300:]  # ends as that API ends
    elif resp.getheader("content-type", "").startswith("text/event-stream") and path == "/v1/responses":
        last = raw.rstrip().rsplit("event: ", 1)[-1]  # typed events: the last one ends the response
        assert last.startswith(("response.completed", "response.incomplete")), raw[-300:]
    elif resp.getheader("content-type", "").startswith("text/event-stream"):
        assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
        assert '"error"' not in raw, raw[-300:]


def test_fuzzing_left_nothing_behind(port):
    wait_idle(port)
    assert metric(port, "kvpage:kv_cache_blocks_used") == 0
    assert request(port, "GET", "/health")[0] == 200

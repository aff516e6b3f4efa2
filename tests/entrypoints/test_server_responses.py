"""OpenAI's Responses API (POST /v1/responses) through a live server and the official client: text replies whole
and as typed stream events, a reply cut by max_output_tokens, forced function calls, a JSON schema text format,
earlier calls and their outputs in the input, and the refusals; no block is left in use."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.server_util import KEY, metric, request, server, wait_idle

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvpage.entrypoints.openai.protocol import APIError  # noqa: E402
from kvpage.entrypoints.openai.response_shape import ResponseShape  # noqa: E402
from kvpage.entrypoints.openai.responses import ResponsesRequest, messages  # noqa: E402
from kvpage.entrypoints.openai.serving import ChatRun, Job  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def srv() -> Iterator[int]:
    with server("--api-key", KEY) as port:
        yield port


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv}/v1", api_key=KEY, max_retries=0)


def test_input_items_become_the_chat():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                         "text": "Oslo?"}]},
             {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Bergen"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "4 C"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 4 C."}]}]
    conv = messages("Be brief.", items)
    assert conv[0] == {"role": "system", "content": "Be brief."}
    assert conv[1] == {"role": "user", "content": "Weather in Oslo?"}
    assert [c["id"] for c in conv[2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one assistant turn
    assert conv[3] == {"role": "tool", "tool_call_id": "c1", "content": "4 C"}
    assert conv[4] == {"role": "assistant", "content": "It is 4 C."}
    assert messages(None, "hi") == [{"role": "user", "content": "hi"}]


def test_an_empty_reply_is_an_empty_message_whole_and_streamed():
    req = ResponsesRequest(input="x")
    run = ChatRun("resp-1", [Job(0, "j", [1, 2])], None, [])
    whole = ResponseShape(req, req.chat(), run, "m")
    whole.whole({"content": ""}, "stop")
    assert [(i["type"], i["content"][0]["text"]) for i in whole.items] == [("message", "")]
    streamed = ResponseShape(req, req.chat(), run, "m")
    kinds = [e["type"] for e in streamed.step({}) + streamed.finish("stop")]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done"]
    assert streamed.items[0]["status"] == "completed" and streamed.items[0]["content"][0]["text"] == ""


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp-1"}, "conversation"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
])
def test_what_is_not_kept_is_refused_by_name(body, param):
    with pytest.raises(APIError) as e:
        ResponsesRequest(**body).chat()
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_a_text_reply_whole_and_streamed(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                instructions="Answer in one sentence.", max_output_tokens=32)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp-")
    assert "Paris" in r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                          instructions="Answer in one sentence.", max_output_tokens=32, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text  # greedy: the same reply both ways
    cut = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=4)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=4,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"


def test_forced_calls_and_a_json_format(client):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "weather" and set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                          tool_choice="required", parallel_tool_calls=False, stream=True))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(pieces)
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Give a number as JSON.", temperature=0, max_output_tokens=24,
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"n"}
    # an earlier call and its output in the input: the next turn answers in text
    r = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16, tools=[WEATHER],
                                tool_choice="none", input=[
                                    {"role": "user", "content": "Weather in Paris?"},
                                    {"type": "function_call", "call_id": "c1", "name": "weather",
                                     "arguments": '{"city": "Paris"}'},
                                    {"type": "function_call_output", "call_id": "c1", "output": "18 C, clear"}])
    assert r.output[0].type == "message" and r.output_text


def test_refusals_reach_the_client_and_leave_nothing_behind(srv, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    status, err = request(srv, "POST", "/v1/responses", {"input": "x", "tools": [WEATHER],
                                                         "tool_choice": {"type": "function", "name": "nope"}})
    assert status == 400 and err["error"]["param"] == "tool_choice"
    status, err = request(srv, "POST", "/v1/responses", {"input": "x", "model": "gpt-4"})
    assert status == 404
    wait_idle(srv)
    assert metric(srv, "kvpage:kv_cache_blocks_used") == 0


def test_output_text_logprobs_whole_and_streamed(srv, client):
    ask = dict(model=MODEL, input="Name a colour.", temperature=0, max_output_tokens=8,
               include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**ask)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and "".join(lp.token for lp in lps) == r.output_text
    for lp in lps:  # greedy: the chosen token is the most likely one
        assert len(lp.top_logprobs) == 2 and lp.logprob == lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
    events = list(client.responses.create(**ask, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in lps]  # the same greedy tokens; their logprobs
    assert all(abs(a.logprob - b.logprob) < 0.05 for a, b in zip(streamed, lps, strict=True))  # alike (cached, bf16)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert len(done.logprobs) == len(lps) and events[-1].response.output[0].content[0].logprobs
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).output[0].content[0].logprobs == []
    status, err = request(srv, "POST", "/v1/responses", {"input": "x", "tools": [WEATHER], "tool_choice": "required",
                                                         "include": ["message.output_text.logprobs"]})
    assert status == 400 and err["error"]["param"] == "include", err

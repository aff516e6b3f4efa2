"""Anthropic's Messages API on a live server: the same greedy text as the chat route, whole and streamed as that
API's events, stop sequences, tool use (forced, and earlier tool_use / tool_result turns rendered), token counts,
errors in that API's shape, and the x-api-key header; no block is left in use."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from tests.entrypoints.test_server_tools import TEMPLATE, WEATHER
from tests.helpers.server_util import KEY, request, template_server, wait_idle

pytest.importorskip("fastapi")

ASK = [{"role": "user", "content": "Name three colors of the rainbow."}]
TOOL = {"name": "weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[int]:
    with template_server(tmp_path_factory.mktemp("messages"), TEMPLATE, "--api-key", KEY) as port:
        yield port


def post(port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                  **({"x-api-key": KEY} if headers is None else headers)})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def test_a_message_reads_as_the_chat_route_writes_it_whole_and_streamed(srv):
    body = {"messages": ASK, "max_tokens": 24, "temperature": 0}
    status, text = post(srv, "/v1/messages", body)
    msg = json.loads(text)
    assert status == 200 and msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    _, chat = request(srv, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 24, "temperature": 0})
    assert [b["type"] for b in msg["content"]] == ["text"]
    assert msg["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    # the reply may end before max_tokens (float32 weights on AVX2-only CPUs answer in fewer tokens than bf16 ones):
    # either way the stop reason is the chat route's in this API's words
    reason = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert msg["stop_reason"] == reason and msg["stop_sequence"] is None
    used = msg["usage"]["output_tokens"]
    assert used == chat["usage"]["completion_tokens"] and msg["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    status, counted = post(srv, "/v1/messages/count_tokens", {"messages": ASK})
    assert status == 200 and json.loads(counted) == {"input_tokens": msg["usage"]["input_tokens"]}
    status, text = post(srv, "/v1/messages", {**body, "stream": True})
    evs = events(text)
    kinds = [k for k, _ in evs]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"], kinds
    assert set(kinds[2:-3]) == {"content_block_delta"}
    streamed = "".join(e["delta"]["text"] for k, e in evs if k == "content_block_delta")
    assert streamed == msg["content"][0]["text"]
    assert evs[-2][1]["delta"]["stop_reason"] == reason and evs[-2][1]["usage"]["output_tokens"] == used
    # vLLM's sampling extras go through: a seed repeats a sampled reply, ignore_eos runs to max_tokens
    seeded = {"messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    first, again = (json.loads(post(srv, "/v1/messages", seeded)[1]) for _ in range(2))
    assert first["content"] == again["content"] and first["usage"]["output_tokens"] == 12
    assert first["stop_reason"] == again["stop_reason"] == "max_tokens"
    # a stop sequence from the greedy text ends it there, named
    word = msg["content"][0]["text"].split()[1]
    _, text = post(srv, "/v1/messages", {**body, "stop_sequences": [word]})
    stopped = json.loads(text)
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == word
    assert word not in stopped["content"][0]["text"] if stopped["content"] else True
    wait_idle(srv)


def test_tool_use_forced_and_earlier_turns(srv):
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 40,
            "temperature": 0, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "weather"}}
    _, text = post(srv, "/v1/messages", body)
    msg = json.loads(text)
    (block,) = msg["content"]
    assert block["type"] == "tool_use" and block["name"] == "weather" and block["id"].startswith("toolu_")
    assert isinstance(block["input"], dict) and isinstance(block["input"].get("city"), str)
    assert msg["stop_reason"] == "tool_use"
    _, text = post(srv, "/v1/messages", {**body, "stream": True})
    evs = events(text)
    start = next(e for k, e in evs if k == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "weather"
    partial = "".join(e["delta"]["partial_json"] for k, e in evs if k == "content_block_delta")
    assert json.loads(partial) == block["input"] and evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    # the call and its result go back as the next turn: rendered into the prompt the template makes of them
    follow = [*body["messages"], {"role": "assistant", "content": [{"type": "tool_use", "id": block["id"],
                                                                    "name": "weather", "input": {"city": "Paris"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                                            "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    status, counted = post(srv, "/v1/messages/count_tokens", {"messages": follow, "tools": [TOOL]})
    status2, rendered = request(srv, "POST", "/tokenize", {"messages": [
        *body["messages"], {"role": "assistant", "content": None, "tool_calls": [
            {"id": block["id"], "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": block["id"], "content": "Sunny, 21 C"}], "tools": [WEATHER]})
    assert status == 200 and status2 == 200 and json.loads(counted)["input_tokens"] == rendered["count"]
    wait_idle(srv)


@pytest.mark.parametrize("body, headers, status, kind, words", [
    ({"messages": ASK}, None, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, None, 400,
     "invalid_request_error", "'image'"),
    ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 64}}, None, 400,
     "invalid_request_error", "thinking"),
    ({"messages": ASK, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, None,
     400, "invalid_request_error", "client tools"),
    ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "sometimes"}}, None, 400, "invalid_request_error",
     "tool_choice"),
    ({"messages": ASK, "max_tokens": 4}, {"x-api-key": "wrong"}, 401, "authentication_error", "API key"),
    ({"messages": ASK, "max_tokens": 4, "model": "other"}, None, 404, "not_found_error", "does not exist"),
    # a lone surrogate as a key is quoted in the message: escaped, never a 500 from the JSON encoder
    ({"messages": {"\ud800": ""}, "max_tokens": 1}, None, 400, "invalid_request_error", "lone UTF-16 surrogate"),
])
def test_errors_take_the_messages_api_shape(srv, body, headers, status, kind, words):
    got, text = post(srv, "/v1/messages", body, headers)
    err = json.loads(text)
    assert got == status and err["type"] == "error" and err["error"]["type"] == kind, text
    assert words in err["error"]["message"], text
    wait_idle(srv)

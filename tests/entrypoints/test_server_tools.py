"""Tool calling through a live server, with the official client: tools and earlier calls rendered into the prompt,
a named and a required tool choice (constrained outputs that come back as calls, whole and streamed), "auto" read
by the Hermes parser, and the refusals; no block is left in use."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers.server_util import KEY, free_port, request, serve_cmd, template_server, wait_idle

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

# A Hermes-style template (not the model's own, which has no tools): the tools as JSON, calls in <tool_call> tags.
TEMPLATE = """{% if tools %}<|im_start|>system
You can call functions. Their signatures:
{% for t in tools %}{{ t | tojson }}
{% endfor %}To call one, write <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}{% for m in messages %}{% if m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>tool {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "description": "The time now"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_REGEX = r'<tool_call>\{"name": "weather", "arguments": \{"city": "Paris"\}\}</tool_call>'


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[int]:
    with template_server(tmp_path_factory.mktemp("tools"), TEMPLATE, "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes") as port:
        yield port


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv}/v1", api_key=KEY, max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": "SmolLM2-135M-Instruct", "messages": ASK, "temperature": 0,
                                             "max_tokens": 48, **kw})


def test_auto_tool_choice_needs_a_parser():
    run = subprocess.run(serve_cmd(free_port(), "--enable-auto-tool-choice"), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "--tool-call-parser" in run.stderr, run.stderr[-500:]


def test_tools_and_earlier_calls_render_into_the_prompt(srv):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, clear"}]
    status, tok = request(srv, "POST", "/tokenize", {"messages": messages, "tools": [WEATHER, TIME]})
    assert status == 200, tok
    text = request(srv, "POST", "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"]
    # tojson as transformers renders it: keys in the client's order, no HTML escaping
    assert '{"type": "function", "function": {"name": "weather", "description": "Current weather in a city"' in text
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool c1\n18 C, clear" in text
    status, out = request(srv, "POST", "/v1/chat/completions", {"messages": messages, "tools": [WEATHER, TIME],
                                                                "max_tokens": 4, "tool_choice": "none"})
    assert status == 200 and out["usage"]["prompt_tokens"] == tok["count"], out


def test_a_named_choice_returns_one_call_of_that_function(client):
    out = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None, choice  # as OpenAI answers it
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    assert set(json.loads(call.function.arguments)) == {"city"}
    pieces = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, temperature=0, max_tokens=48, stream=True, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "weather"}}))
    calls = [c for p in pieces if p.choices for c in (p.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "weather" and calls[0].id.startswith("chatcmpl-tool-")
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    assert json.loads("".join(c.function.arguments for c in calls)) == json.loads(call.function.arguments)
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "stop"
    out = chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}, n=3,
               temperature=1.0, seed=5)  # sampled choices, each its own call
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    ids = {c.message.tool_calls[0].id for c in out.choices}
    assert len(ids) == 3 and all(set(json.loads(c.message.tool_calls[0].function.arguments)) == {"city"}
                                 for c in out.choices)


def test_a_required_choice_returns_calls_of_the_tools(client):
    out = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls  # one call: parallel_tool_calls false
    assert call.function.name in {"weather", "time"} and isinstance(json.loads(call.function.arguments), dict)
    pieces = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, temperature=0, max_tokens=64, stream=True,
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    calls = [c for p in pieces if p.choices for c in (p.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name,
                                                                        call.function.arguments)]
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "tool_calls"


def test_auto_reads_calls_the_model_writes_and_leaves_text_alone(client):
    # the regex makes the model write a call in the Hermes form, which the parser then reads
    out = chat(client, tools=[WEATHER], extra_body={"structured_outputs": {"regex": CALL_REGEX}}, max_tokens=40)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("weather", {"city": "Paris"})]
    pieces = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, temperature=0, max_tokens=40, stream=True, tools=[WEATHER],
        extra_body={"structured_outputs": {"regex": r"It is sunny\. " + CALL_REGEX}}))
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    calls = [c for p in pieces if p.choices for c in (p.choices[0].delta.tool_calls or [])]
    assert text == "It is sunny. " and [c.function.name for c in calls] == ["weather"]
    assert "<tool_call>" not in text and [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "tool_calls"
    plain = chat(client, tools=[WEATHER], extra_body={"structured_outputs": {"choice": ["I cannot say."]}})
    assert plain.choices[0].message.content == "I cannot say." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "time"}}}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"tools": [WEATHER], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_refusals_name_the_field_and_leave_nothing_behind(srv, body, param):
    status, err = request(srv, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param, err
    wait_idle(srv)

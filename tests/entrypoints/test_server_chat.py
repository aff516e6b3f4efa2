"""Requests beyond the plain turn, as vLLM's server takes them: a server-wide chat template (--chat-template), a
request's own (with --trust-request-chat-template), the last message continued (continue_final_message), echo,
/tokenize rendering messages exactly as a chat completion does, the response's token ids and id
(return_token_ids, request_id), structured outputs in OpenAI's and vLLM's spellings, and CORS limited to named
origins (--allowed-origins)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.server_util import KEY, raw_call, request, stream_raw, template_server, wait_idle

pytest.importorskip("fastapi")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} says\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant says\n{% endif %}")  # not the model's own
CONTINUED = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color I pick is"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[int]:
    with template_server(tmp_path_factory.mktemp("chat"), TEMPLATE, "--trust-request-chat-template",
                         "--allowed-origins", '["https://ui.example"]') as port:
        yield port


def streamed(port: int, path: str, body: dict) -> list[dict]:
    """Every event of a streamed request, up to [DONE]."""
    sock, got = stream_raw(port, path, body)
    while b"data: [DONE]" not in got:
        chunk = sock.recv(65536)
        assert chunk, "the stream ended before [DONE]"
        got += chunk
    sock.close()
    return [json.loads(line[6:]) for line in got.decode().splitlines() if line.startswith("data: {")]


def prompt_text(port: int, body: dict) -> str:
    status, tok = request(port, "POST", "/tokenize", body)
    assert status == 200, tok
    status, text = request(port, "POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200
    return text["prompt"]


def test_the_servers_template_renders_chats_and_tokenize_alike(srv):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert prompt_text(srv, {"messages": messages}) == (
        "<|im_start|>system says\nBe brief.<|im_end|>\n<|im_start|>user says\nhi<|im_end|>\n"
        "<|im_start|>assistant says\n")
    tok = request(srv, "POST", "/tokenize", {"messages": messages})[1]
    status, body = request(srv, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == tok["count"]


def test_a_trusted_request_template_and_its_errors(srv):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "[{{ messages[0].content }}]"}
    assert prompt_text(srv, body) == "[hi]"
    status, err = request(srv, "POST", "/v1/chat/completions", {**body, "chat_template": "{% for %}"})
    assert status == 400 and err["error"]["param"] == "chat_template" and "does not compile" in err["error"]["message"]
    status, err = request(srv, "POST", "/v1/chat/completions",
                          {**body, "chat_template": None, "chat_template_kwargs": {"chat_template": "x"}})
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message_leaves_the_last_message_open(srv):
    body = {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False}
    assert prompt_text(srv, body).endswith("<|im_start|>assistant says\nThe color I pick is")
    status, out = request(srv, "POST", "/v1/chat/completions", {**body, "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    status, err = request(srv, "POST", "/v1/chat/completions", {"messages": CONTINUED, "continue_final_message": True})
    assert status == 400 and "add_generation_prompt" in err["error"]["message"]


def test_echo_puts_the_assistants_last_message_first(srv):
    body = {"messages": CONTINUED, "echo": True, "max_tokens": 4, "temperature": 0}
    status, out = request(srv, "POST", "/v1/chat/completions", body)
    assert status == 200
    echoed = out["choices"][0]["message"]["content"]
    plain = request(srv, "POST", "/v1/chat/completions", {**body, "echo": False})[1]
    assert echoed == "The color I pick is" + plain["choices"][0]["message"]["content"]
    status, out = request(srv, "POST", "/v1/chat/completions", {**body, "messages": CONTINUED[:1]})  # a user's: none
    alone = request(srv, "POST", "/v1/chat/completions", {**body, "messages": CONTINUED[:1], "echo": False})[1]
    assert status == 200 and out["choices"][0]["message"] == alone["choices"][0]["message"]
    deltas = [e["choices"][0]["delta"] for e in streamed(srv, "/v1/chat/completions", {**body, "stream": True})]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "The color I pick is"}
    assert "".join(d.get("content", "") for d in deltas) == echoed  # greedy: the same reply, streamed
    wait_idle(srv)


def test_return_token_ids_and_request_id_as_vllm_returns_them(srv):
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "n": 2, "return_token_ids": True,
            "request_id": "client-7"}
    status, out = request(srv, "POST", "/v1/completions", body)
    prompt = request(srv, "POST", "/tokenize", {"prompt": body["prompt"]})[1]["tokens"]
    assert status == 200 and out["id"] == "cmpl-client-7"
    detok = request(srv, "POST", "/detokenize", {"tokens": out["choices"][0]["token_ids"]})[1]["prompt"]
    assert detok == out["choices"][0]["text"] and all(c["prompt_token_ids"] == prompt for c in out["choices"])
    status, again = request(srv, "POST", "/v1/completions", body)  # the same request_id again: served as well
    assert status == 200 and again["choices"] == out["choices"]
    chunks = [e["choices"][0] for e in streamed(srv, "/v1/completions", {**body, "stream": True})]
    for i in range(2):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["prompt_token_ids"] == prompt and all(c["prompt_token_ids"] is None for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == out["choices"][i]["token_ids"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_token_ids": True}
    status, out = request(srv, "POST", "/v1/chat/completions", chat)
    assert status == 200 and out["prompt_token_ids"] == request(srv, "POST", "/tokenize", chat)[1]["tokens"]
    assert len(out["choices"][0]["token_ids"]) == out["usage"]["completion_tokens"]
    status, plain = request(srv, "POST", "/v1/chat/completions", {**chat, "return_token_ids": False})
    assert status == 200 and "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    wait_idle(srv)


def test_truncation_side_and_fields_kvpage_cannot_honour(srv):
    prompt = "one two three four five six"
    ids = request(srv, "POST", "/tokenize", {"prompt": prompt})[1]["tokens"]
    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 2, "return_token_ids": True}
    for side, kept in ((None, ids[-2:]), ("left", ids[-2:]), ("right", ids[:2])):
        status, out = request(srv, "POST", "/v1/completions", {**body, "truncation_side": side})
        assert status == 200 and out["choices"][0]["prompt_token_ids"] == kept, side
    assert request(srv, "POST", "/v1/completions", {**body, "truncation_side": "middle"})[0] == 400
    for field, value in (("vllm_xargs", {"a": 1}), ("logprob_token_ids", [5]), ("kv_transfer_params", {"x": 1})):
        status, err = request(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: value})
        assert status == 400 and err["error"]["param"] == field, field
        assert request(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: None})[0] == 200
    wait_idle(srv)


def test_structured_outputs_in_each_spelling(srv):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
              "additionalProperties": False}
    chat = {"messages": [{"role": "user", "content": "Name a city, as JSON."}], "max_tokens": 32, "temperature": 0}
    status, out = request(srv, "POST", "/v1/chat/completions", {
        **chat, "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    assert status == 200, out
    assert set(json.loads(out["choices"][0]["message"]["content"])) == {"city"}
    events = streamed(srv, "/v1/chat/completions", {**chat, "stream": True, "structured_outputs": {"json": schema}})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert set(json.loads(text)) == {"city"}
    status, out = request(srv, "POST", "/v1/completions", {
        "prompt": "Give a JSON object with a name and an age:", "max_tokens": 96, "temperature": 0,
        "response_format": {"type": "json_object"}})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
    assert isinstance(json.loads(out["choices"][0]["text"]), dict)
    body = {"prompt": "Is water wet? Answer:", "max_tokens": 8, "n": 3, "seed": 2}
    for fields in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        status, out = request(srv, "POST", "/v1/completions", {**body, **fields})
        assert status == 200 and {c["text"] for c in out["choices"]} <= {"yes", "no"}, out
    status, out = request(srv, "POST", "/v1/completions", {**body, "guided_regex": r"[0-9]{4}"})
    assert status == 200 and all(len(c["text"]) == 4 and c["text"].isdigit() for c in out["choices"])
    for fields, param in (({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                          ({"guided_regex": "(("}, "structured_outputs"),
                          ({"response_format": {"type": "json_schema"}}, "response_format"),
                          ({"response_format": {"type": "yaml"}}, "response_format"),
                          ({"structured_outputs": {"regex": "a", "whitespace_pattern": " +"}}, "structured_outputs"),
                          ({"guided_choice": ["a"], "use_beam_search": True, "n": 2}, "use_beam_search")):
        status, err = request(srv, "POST", "/v1/completions", {**body, **fields})
        assert status == 400 and err["error"]["param"] == param, (fields, err)
    wait_idle(srv)


def test_cors_answers_only_the_named_origins(srv):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    status, h = raw_call(srv, "OPTIONS", "/v1/completions", {"Origin": "https://ui.example", **preflight})
    assert status == 200 and h["access-control-allow-origin"] == "https://ui.example", h
    status, h = raw_call(srv, "OPTIONS", "/v1/completions", {"Origin": "https://elsewhere.example", **preflight})
    assert status == 400 and "access-control-allow-origin" not in h, h
    status, h = raw_call(srv, "POST", "/v1/completions", {"Origin": "https://elsewhere.example",
                                                          "Authorization": f"Bearer {KEY}",
                                                          "Content-Type": "application/json"},
                         json.dumps({"prompt": "hi", "max_tokens": 1}))
    assert status == 200 and "access-control-allow-origin" not in h, h  # served; a browser keeps it from the page


def test_structural_tags_in_both_spellings(srv):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    tag = {"structures": [{"begin": "<function=weather>", "schema": schema, "end": "</function>"}],
           "triggers": ["<function="]}
    body = {"prompt": "Call the weather tool for Oslo: <function=weather>", "max_tokens": 16, "temperature": 0}
    for fields in ({"response_format": {"type": "structural_tag", **tag}},
                   {"structured_outputs": {"structural_tag": json.dumps(tag)}},
                   {"structured_outputs": {"structural_tag": ""}}):  # "": none, as before
        status, out = request(srv, "POST", "/v1/completions", {**body, **fields})
        assert status == 200, (fields, out)
    status, err = request(srv, "POST", "/v1/completions", {**body, "response_format": {
        "type": "structural_tag", "structures": tag["structures"], "triggers": ["<tool="]}})
    assert status == 400 and "none of the triggers" in err["error"]["message"], err
    # xgrammar's format form, as response_format and as structured_outputs' JSON text
    call = {"type": "tag", "begin": "<function=weather>", "content": {"type": "json_schema", "json_schema": schema},
            "end": "</function>"}
    fmt = {"type": "triggered_tags", "triggers": ["<function="], "tags": [call], "at_least_one": True,
           "stop_after_first": True}
    for fields in ({"response_format": {"type": "structural_tag", "format": fmt}},
                   {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}}):
        status, out = request(srv, "POST", "/v1/completions", {**body, "prompt": "Call the weather tool:", **fields})
        assert status == 200 and out["choices"][0]["text"].startswith("<function=weather>{"), (fields, out)
    status, err = request(srv, "POST", "/v1/completions", {**body, "response_format": {
        "type": "structural_tag", "format": {"type": "token", "token": 1}}})
    assert status == 400 and "token-level" in err["error"]["message"], err
    wait_idle(srv)

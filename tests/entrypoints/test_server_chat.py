"""Chat requests beyond the plain turn, as vLLM's server takes them: a server-wide template (--chat-template), a
request's own (with --trust-request-chat-template), the last message continued (continue_final_message), echo,
and /tokenize rendering messages exactly as a chat completion does."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.server_util import KEY, request, server, stream_raw, wait_idle

pytest.importorskip("fastapi")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} says\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant says\n{% endif %}")  # not the model's own
CONTINUED = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color I pick is"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[int]:
    path = tmp_path_factory.mktemp("chat") / "chat.jinja"
    path.write_text(TEMPLATE)
    with server("--api-key", KEY, "--chat-template", str(path), "--trust-request-chat-template") as port:
        yield port


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
    sock, got = stream_raw(srv, "/v1/chat/completions", {**body, "stream": True})
    while b"data: [DONE]" not in got:
        chunk = sock.recv(65536)
        assert chunk
        got += chunk
    sock.close()
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in got.decode().splitlines()
              if line.startswith("data: {")]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "The color I pick is"}
    assert "".join(d.get("content", "") for d in deltas) == echoed  # greedy: the same reply, streamed
    wait_idle(srv)

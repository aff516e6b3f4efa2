"""A model without a chat template, served: chats refused by name (pointing to --chat-template), and
add_special_tokens deciding the BOS of a text prompt (a tiny random Llama whose tokenizer adds one). The same
server runs with --no-dashboard (one server start fewer than a server of its own for that flag)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.server_util import KEY, request, server, wait_idle
from tests.helpers.tiny_models import make_hf_model

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[int]:
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model(path, "llama")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with server("--api-key", KEY, "--model", str(path), "--dtype", "float32", "--max-model-len", "256",
                "--no-dashboard") as port:
        yield port


def test_no_dashboard_flag(srv):
    assert request(srv, "GET", "/dashboard")[0] == 404
    assert request(srv, "GET", "/dashboard/snapshot")[0] == 404
    assert request(srv, "GET", "/v1/models")[0] == 200  # the API itself is there


def test_chats_are_refused_by_name_without_a_template(srv):
    for path in ("/v1/chat/completions", "/tokenize"):
        status, err = request(srv, "POST", path, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 400 and err["error"]["param"] == "messages", path
        assert "no chat template" in err["error"]["message"] and "--chat-template" in err["error"]["message"]


def test_add_special_tokens_decides_the_bos(srv):
    body = {"prompt": "paged attention", "max_tokens": 1, "return_token_ids": True}
    with_bos = request(srv, "POST", "/v1/completions", body)[1]["choices"][0]["prompt_token_ids"]
    without = request(srv, "POST", "/v1/completions", {**body, "add_special_tokens": False})[1]
    assert with_bos[0] == 0 and with_bos[1:] == without["choices"][0]["prompt_token_ids"]  # <s> is id 0
    wait_idle(srv)

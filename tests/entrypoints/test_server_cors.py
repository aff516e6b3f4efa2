"""CORS as vLLM's server defaults it: a page on any origin may call the API, a preflight is answered before the
key is asked for, and the key still guards every request (--allowed-origins narrowing it: test_server_chat.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.server_util import KEY, raw_call, server

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def srv() -> Iterator[int]:
    with server("--api-key", KEY) as port:
        yield port


def test_browsers_on_other_origins_may_call_the_api(srv):
    ui = "https://ui.example"
    status, h = raw_call(srv, "OPTIONS", "/v1/chat/completions", {
        "Origin": ui, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # a preflight: no key, answered first
    assert status == 200 and h["access-control-allow-origin"] == "*", h
    assert "POST" in h["access-control-allow-methods"] and "authorization" in h["access-control-allow-headers"]
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    for key, expected in ((KEY, 200), (None, 401)):  # the key still guards the API; the page can read why
        headers = {"Origin": ui, "Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        status, h = raw_call(srv, "POST", "/v1/completions", headers, body)
        assert status == expected and h["access-control-allow-origin"] == "*", (status, h)

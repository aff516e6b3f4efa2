"""The operator routes on a live server: /ping answers as /health does, and /pause (keep, wait, abort) holds new
requests until /resume without refusing them, freezes or ends the open ones, and leaves no block behind."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.server_util import KEY, metric, request, server, stream_raw, wait_idle

pytest.importorskip("fastapi")

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Here is a short list of facts about the primary colors of paint. The three primary colors are"


@pytest.fixture(scope="module")
def srv() -> Iterator[int]:
    with server("--api-key", KEY) as port:
        yield port


def read_stream(s, got: bytes) -> bytes:
    """The rest of a raw streamed response, to its [DONE]."""
    while b"data: [DONE]" not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    s.close()
    return got


def test_pause_keep_wait_and_abort_hold_new_requests_until_resume(srv):
    model_id = MODEL
    assert request(srv, "GET", "/ping", key=None)[0] == 200 and request(srv, "POST", "/ping", key=None)[0] == 200
    assert request(srv, "POST", "/pause", key=None)[0] == 401 and request(srv, "GET", "/is_paused", key=None)[0] == 401
    for query, param in (("mode=sometimes", "mode"), ("mode=keep&clear_cache=true", "clear_cache"),
                         ("clear_cache=maybe", "clear_cache")):
        status, body = request(srv, "POST", f"/pause?{query}")
        assert status == 400 and body["error"]["param"] == param, body
    assert request(srv, "GET", "/is_paused") == (200, {"is_paused": False})
    long = {"model": model_id, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    s, got = stream_raw(srv, "/v1/completions", long)  # running: its first token is out
    assert request(srv, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert request(srv, "GET", "/is_paused") == (200, {"is_paused": True})
    assert request(srv, "GET", "/dashboard/snapshot")[1]["paused"] is True  # the pool's page says so too
    assert request(srv, "GET", "/load") == (200, {"server_load": 1})  # the kept request
    assert metric(srv, "kvpage:kv_cache_blocks_used") > 0  # the kept request holds its blocks
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(request, srv, "POST", "/v1/completions",
                           {"model": model_id, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        time.sleep(0.5)
        assert not held.done()  # held, not refused
        assert request(srv, "GET", "/load")[1] == {"server_load": 2}  # the held one counts too
        # a pause that waits for the open request: the kept one runs on to its end, the new one stays held
        waited = pool.submit(request, srv, "POST", "/pause?mode=wait")
        events = read_stream(s, got).decode()
        assert waited.result(timeout=60) == (200, {"status": "paused"}) and not held.done()
        assert '"finish_reason":"length"' in events.replace(" ", "")
        assert request(srv, "POST", "/resume") == (200, {"status": "resumed"})
        status, body = held.result(timeout=60)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    s, got = stream_raw(srv, "/v1/completions", long)
    assert request(srv, "POST", "/pause?mode=abort&clear_cache=true") == (200, {"status": "paused"})
    events = read_stream(s, got).decode()
    assert '"finish_reason":"abort"' in events.replace(" ", ""), events[-400:]
    assert request(srv, "POST", "/resume")[0] == 200 and request(srv, "GET", "/is_paused")[1] == {"is_paused": False}
    wait_idle(srv)
    assert request(srv, "GET", "/load") == (200, {"server_load": 0})
    assert request(srv, "GET", "/load", key=None)[0] == 401

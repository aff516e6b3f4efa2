"""The operator routes on a live server: /ping answers as /health does, and /pause (keep, wait, abort) holds new
requests until /resume without refusing them, freezes or ends the open ones, and leaves no block behind; streams
that a pause holds get keep-alive beats (--sse-keep-alive-interval) and end as usual."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
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
    with server("--api-key", KEY, "--sse-keep-alive-interval", "0.3") as port:
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


def read_for(s: socket.socket, got: bytes, seconds: float) -> bytes:
    """Whatever a raw stream sends within ``seconds``, after ``got``."""
    s.settimeout(0.2)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with contextlib.suppress(TimeoutError):
            got += s.recv(65536)
    s.settimeout(60)
    return got


def test_streams_frozen_by_a_pause_get_keep_alive_beats(srv):
    """With --sse-keep-alive-interval 0.3, a stream that goes silent (here frozen by a pause that keeps it) gets
    an SSE comment every 0.3 s, an Anthropic Messages stream that API's ping events, and both run to their usual
    end after /resume; the official client reads such a stream as any other."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv}/v1", api_key=KEY, max_retries=0, timeout=60)
    started = []

    def chat() -> str:
        text = ""
        for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to 50."}],
                                                max_tokens=200, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}):
            started.append(1)
            text += c.choices[0].delta.content or "" if c.choices else ""
        return text

    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    plain, got_plain = stream_raw(srv, "/v1/completions", long)
    hi = {"model": MODEL, "max_tokens": 200, "stream": True, "ignore_eos": True,
          "messages": [{"role": "user", "content": "Hi"}]}
    anth, got_anth = stream_raw(srv, "/v1/messages", hi)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(chat)
        while not started:
            time.sleep(0.05)
        assert request(srv, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
        got_plain, got_anth = read_for(plain, got_plain, 0.5), read_for(anth, got_anth, 0.5)  # frozen by now
        quiet_plain, quiet_anth = read_for(plain, b"", 1.2), read_for(anth, b"", 1.2)
        assert request(srv, "POST", "/resume") == (200, {"status": "resumed"})
        assert len(reply.result(timeout=120)) > 20  # the client skipped the comments and read the whole reply
    assert quiet_plain.count(b": keep-alive\n\n") >= 2 and b"data:" not in quiet_plain, quiet_plain
    assert quiet_anth.count(b'event: ping\ndata: {"type": "ping"}\n\n') >= 2, quiet_anth
    assert b'"finish_reason":"length"' in read_stream(plain, got_plain + quiet_plain).replace(b" ", b"")
    got_anth += quiet_anth
    while b"event: message_stop" not in got_anth:
        chunk = anth.recv(65536)
        assert chunk, got_anth[-300:]
        got_anth += chunk
    anth.close()
    wait_idle(srv)
    assert metric(srv, "kvpage:kv_cache_blocks_used") == 0


def test_a_bad_keep_alive_interval_is_refused_before_the_model_loads():
    for value in ("-1", "nan", "soon"):
        done = subprocess.run([sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--sse-keep-alive-interval",
                               value], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "--sse-keep-alive-interval" in done.stderr, done

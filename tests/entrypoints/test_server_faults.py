"""What no client may do to `kvpage serve`: kill the engine, hang a request, get a 500 for bad input, exhaust
memory, or cut a stream on shutdown without an error and [DONE]. Real server processes on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.fault_server import FATAL_SEED, OUTPUT_FAULT_SEED, SAMPLE_FAULT_SEED
from tests.helpers.server_util import KEY, metric, request, serve_cmd, server, server_log, server_proc, wait_idle

pytest.importorskip("fastapi")

MAX_LEN = 256


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[int, subprocess.Popen]]:
    """Key from the environment, short HTTP deadlines, a short context (so that fuzzed requests stay short)."""
    with server_proc(serve_cmd, "--max-model-len", str(MAX_LEN), "--max-n", "4", "--http-timeout", "2",
                     "--max-body-bytes", str(1 << 20), env={"KVPAGE_API_KEY": KEY}) as pp:
        yield pp


@pytest.fixture(scope="module")
def port(live) -> int:
    return live[0]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def sse_events(port: int, path: str, body: dict, timeout: float = 60) -> list[dict | str]:
    """Every event of a stream, parsed; the last one must be the literal [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200, raw
    events: list[dict | str] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_gauges_exist_before_the_first_request(port):
    _, text = request(port, "GET", "/metrics")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_blocks_used",
                 "kv_cache_blocks_total"):
        assert f"kvpage:{name}{{" in text, name


@pytest.mark.parametrize("extra", [
    {"top_p": 1e-300}, {"temperature": 1e-300}, {"temperature": 1e-6}, {"min_p": 1e-300},
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300}, {"repetition_penalty": 1e-30, "temperature": 1e-4},
    {"presence_penalty": -2, "frequency_penalty": 2, "temperature": 5e-5}, {"temperature": 1e30},
    {"top_k": 1, "top_p": 1e-45, "min_p": 1.0}, {"logit_bias": {"28": 100, "29": -100}},
    {"allowed_token_ids": [2], "min_tokens": 3},  # the only allowed token is EOS, blocked: falls back, no NaN
])
def test_degenerate_sampling_settings_are_their_limits(port, extra):
    status, body = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 6, **extra})
    assert status == 200, body
    assert request(port, "GET", "/health")[0] == 200


def test_a_temperature_too_small_to_represent_is_greedy(port):
    greedy = request(port, "POST", "/v1/completions", {"prompt": "The sky is", "max_tokens": 8, "temperature": 0})
    tiny = request(port, "POST", "/v1/completions", {"prompt": "The sky is", "max_tokens": 8, "temperature": 1e-300})
    assert greedy[1]["choices"][0]["text"] == tiny[1]["choices"][0]["text"]


DEEP = '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"


@pytest.mark.parametrize(("path", "raw", "words"), [
    ("/v1/completions", DEEP, "nested deeper"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + "[" * 40 + "]" * 40 + "}]}",
     "nested deeper"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", "digits"),
    ("/v1/completions", '{"prompt": "hi", "seed": -' + "9" * 100 + "}", "digits"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "NaN"),
    ("/v1/completions", '{"prompt": "hi", "top_p": -Infinity}', "Infinity"),
    ("/v1/completions", '{"prompt": "hi", "temperature": 1e999}', "out of range"),
    ("/v1/completions", '{"prompt": "\\ud800 lone"}', "surrogate"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a \\udc80"}]}', "surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "surrogate"),
    ("/tokenize", '{"prompt": "\\ud800"}', "surrogate"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    ("/v1/completions", '[1, 2]', "must be an object"),
    ("/v1/completions", '{"prompt": "hi", "stop": "\\ud800"}', "surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     "tools[0].function needs a name"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
     "needs tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                             '"tools": [{"type": "function", "function": {"name": "f"}}]}',  # auto, and no parser
     "needs a server started with --enable-auto-tool-choice"),
    ("/v1/completions", '{"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}',
     "for chat completions"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}',
     "functions is not supported"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                             '"response_format": {"type": "yaml"}}', "response_format type 'yaml' is not supported"),
    ("/v1/completions", '{"prompt": "x", "use_beam_search": true, "stream": true}', "does not stream"),
    ("/v1/completions", '{"prompt": "x", "use_beam_search": true, "top_p": 0.5}', "top_p has no meaning"),
    ("/v1/completions", '{"prompt": "x", "use_beam_search": true, "n": 2, "best_of": 1}', "n must"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "use_beam_search": true, '
                             '"early_stopping": "soon"}', "early_stopping"),
    ("/v1/completions", '{"prompt": "x", "guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}',
     "guided_whitespace_pattern is not supported"),
    ("/v1/completions", '{"prompt": "x", "guided_json": {"type": "nothing"}}', "structured_outputs"),
    ("/v1/completions", '{"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}', "one output form"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"x1": 3}}', "logit_bias keys"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"1": 300}}', "logit_bias values"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"99999999": 1}}', "outside the vocabulary"),
    ("/v1/completions", '{"prompt": "x", "allowed_token_ids": []}', "allowed_token_ids"),
    ("/v1/completions", '{"prompt": "x", "truncate_prompt_tokens": 0}', "truncate_prompt_tokens"),
])
def test_malformed_input_is_a_4xx_that_names_it(port, path, raw, words):
    status, err = request(port, "POST", path, raw)
    assert 400 <= status < 500, (status, err)
    assert words in err["error"]["message"], err


def test_neutral_values_of_unsupported_fields_are_served(port):
    status, body = request(port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": None, "tool_choice": "none",
        "response_format": {"type": "text"}, "logit_bias": {}, "prompt_logprobs": None})
    assert status == 200, body


def test_body_limit_holds_while_reading_a_chunked_body(live):
    port, proc = live
    before = rss_mib(proc.pid)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def chunks():
        piece = b" " * (1 << 20)
        for _ in range(400):  # 400 MiB offered; the limit is 1 MiB
            yield piece

    t0 = time.time()
    try:
        conn.request("POST", "/v1/completions", body=chunks(), encode_chunked=True,
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                              "Transfer-Encoding": "chunked"})
        resp = conn.getresponse()
        status, text = resp.status, resp.read().decode()
    except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before we stopped sending
        status, text = 413, "closed early"
    assert status == 413, text
    assert time.time() - t0 < 20
    assert rss_mib(proc.pid) - before < 100
    status, err = request(port, "POST", "/v1/completions", "x" * 2_000_000)  # declared too long: refused unread
    assert status == 413 and "exceeds" in err["error"]["message"]


def test_slow_clients_are_cut_off(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    t0 = time.time()
    assert s.recv(1024) == b""  # closed by the server ...
    assert 1.5 < time.time() - t0 < 8  # ... after --http-timeout (2 s)
    s.close()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
              "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
    reply = b""
    while b"did not arrive" not in reply and (chunk := s.recv(4096)):
        reply += chunk
    s.close()
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "did not arrive" in reply


def test_key_is_checked_and_the_schema_is_behind_it(port):
    assert request(port, "GET", "/openapi.json", key=None)[0] == 401
    assert request(port, "GET", "/openapi.json", key="wrong")[0] == 401
    status, schema = request(port, "GET", "/openapi.json")
    assert status == 200 and "/v1/completions" in schema["paths"]
    assert request(port, "GET", "/v1/models", key="test-kez")[0] == 401


def test_streamed_n_reports_each_finish_once(port):
    events = sse_events(port, "/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "n": 3, "seed": 3,
                                                   "stop": ["e"]})
    assert events[-1] == "[DONE]"
    finishes = [ch["index"] for ev in events[:-1] for ch in ev["choices"] if ch["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]
    events = sse_events(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 4, "n": 2, "ignore_eos": True})
    finishes = [ch["index"] for ev in events[:-1] for ch in ev["choices"] if ch["finish_reason"]]
    assert sorted(finishes) == [0, 1]


def test_key_from_a_file_queue_limit_sends_retry_after(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    with server("--api-key-file", str(key_file), "--max-num-seqs", "1", "--max-queue", "1", "--no-openapi") as port:
        assert request(port, "GET", "/v1/models", key=None)[0] == 401
        assert request(port, "GET", "/openapi.json")[0] == 404
        long = json.dumps({"prompt": "A long story", "max_tokens": 150, "ignore_eos": True, "stream": True}).encode()
        socks = []
        for gauge in ("running", "waiting"):  # one runs, one waits (seconds apiece, one at a time)
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(long)}\r\n\r\n".encode() + long)
            socks.append(s)
            deadline = time.time() + 20
            while metric(port, f"kvpage:num_requests_{gauge}") < 1 and time.time() < deadline:
                time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        assert resp.status == 429 and resp.getheader("Retry-After") == "1", resp.read()
        for s in socks:  # both clients leave: their requests are aborted and free their blocks
            s.close()
        wait_idle(port)


# ------------------------------------------------------------------ faults inside the engine
def fault_cmd(port: int, *extra: str) -> list[str]:
    script = Path(__file__).resolve().parents[1] / "helpers" / "fault_server.py"
    return [sys.executable, str(script), "--port", str(port), *extra]


def test_a_request_that_fails_in_the_engine_fails_alone():
    with server_proc(fault_cmd, key=None) as (port, proc):
        results: dict[str, object] = {}

        def normal(i: int) -> None:
            results[f"ok{i}"] = sse_events(port, "/v1/completions", {"prompt": f"Story {i}:", "max_tokens": 24,
                                                                     "ignore_eos": True, "seed": i})

        def faulty(name: str, seed: int, stream: bool) -> None:
            body = {"prompt": "Faulty", "max_tokens": 24, "ignore_eos": True, "seed": seed}
            results[name] = sse_events(port, "/v1/completions", body) if stream else \
                request(port, "POST", "/v1/completions", body)

        threads = [threading.Thread(target=normal, args=(i,)) for i in range(6)]
        threads += [threading.Thread(target=faulty, args=("sample", SAMPLE_FAULT_SEED, True)),
                    threading.Thread(target=faulty, args=("output", OUTPUT_FAULT_SEED, False))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i in range(6):
            events = results[f"ok{i}"]
            assert events[-1] == "[DONE]"
            assert [ch["finish_reason"] for ev in events[:-1] for ch in ev["choices"]][-1] == "length"
            assert len(events) == 25  # 24 tokens, one event each, then [DONE]
        sampled = results["sample"]
        assert sampled[-1] == "[DONE]" and "sampling failed" in sampled[-2]["error"]["message"]
        status, err = results["output"]
        assert status == 500 and "output processing failed" in err["error"]["message"]
        assert request(port, "GET", "/health", key=None)[0] == 200
        status, body = request(port, "POST", "/v1/completions", {"prompt": "after", "max_tokens": 3}, key=None)
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        wait_idle(port)

        # A failed model step is fatal: every open request fails at once and the process exits 1.
        def long_one(i: int) -> None:
            results[f"long{i}"] = sse_events(port, "/v1/completions", {"prompt": f"Long {i}", "max_tokens": 500,
                                                                       "ignore_eos": True})

        longs = [threading.Thread(target=long_one, args=(i,)) for i in range(3)]
        for t in longs:
            t.start()
        deadline = time.time() + 20
        while metric(port, "kvpage:num_requests_running") < 3 and time.time() < deadline:
            time.sleep(0.05)
        status, err = request(port, "POST", "/v1/completions", {"prompt": "boom", "max_tokens": 4,
                                                                "seed": FATAL_SEED}, key=None)
        assert status == 500 and "injected kernel failure" in err["error"]["message"]
        for t in longs:
            t.join(30)
        for i in range(3):
            events = results[f"long{i}"]
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
        assert proc.wait(timeout=30) == 1
        assert "injected kernel failure" in server_log(proc)


# ------------------------------------------------------------------ shutdown
def open_stream(port: int, body: dict) -> tuple[socket.socket, list[bytes]]:
    """A stream read by a thread into a list (so that the test can signal the server meanwhile)."""
    data = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=90)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    got: list[bytes] = []

    def read() -> None:
        while chunk := s.recv(65536):
            got.append(chunk)

    threading.Thread(target=read, daemon=True).start()
    return s, got


def test_sigterm_drains_then_fails_what_is_left_and_exits_0():
    with server_proc(serve_cmd, "--api-key", KEY, "--shutdown-timeout", "3") as (port, proc):
        # short enough to finish inside the 3 s grace period on a loaded 2-core machine (40 tokens did not, once)
        _, short = open_stream(port, {"prompt": "Short", "max_tokens": 12})
        _, long = open_stream(port, {"prompt": "Long", "max_tokens": 1000, "ignore_eos": True})
        deadline = time.time() + 20
        while not (short and long) and time.time() < deadline:
            time.sleep(0.05)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(OSError):  # no new connections while draining
            socket.create_connection(("127.0.0.1", port), timeout=2)
        assert proc.wait(timeout=30) == 0
        assert 2.5 < time.time() - t0 < 20
        log = server_log(proc)
        short_text, long_text = b"".join(short).decode(), b"".join(long).decode()
        assert '"finish_reason": "length"' in short_text or '"finish_reason": "stop"' in short_text
        for text in (short_text, long_text):  # each a complete chunked response whose last event is [DONE]
            assert text.endswith("data: [DONE]\n\n\r\n0\r\n\r\n"), text[-200:]
        assert '"error"' not in short_text
        assert "grace period" in long_text
        assert "0 KV blocks in use" in log, log


def test_a_second_signal_exits_at_once():
    with server_proc(serve_cmd, "--api-key", KEY, "--shutdown-timeout", "60") as (port, proc):
        _, long = open_stream(port, {"prompt": "Long", "max_tokens": 1000, "ignore_eos": True})
        deadline = time.time() + 20
        while not long and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining: the stream goes on
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) != 0
        assert time.time() - t0 < 5


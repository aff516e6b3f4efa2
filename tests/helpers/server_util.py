"""Shared helpers for the tests that run `kvpage serve` as a real process on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Test servers keep the KV cache and the packed weights on the allocator's pages: on these VMs each fresh 2 MiB
# page costs ~7 ms to fault in (~1.7 s of a SmolLM2 server's ~7 s start), and what the HTTP tests check does not
# depend on page size. The huge-page paths have their own tests (tests/test_pages.py, test_weight_arena.py,
# tests/worker/test_worker.py), and test_server.py's module server runs the defaults (``huge_pages=True``).
SMALL_PAGES = ("--no-kv-huge-pages",)
SMALL_PAGES_ENV = {"KVPAGE_WEIGHT_HUGE_PAGES": "0"}


def serve_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--port", str(port), "--kv-cache-memory",
            "256MiB", "--max-model-len", "1024", *SMALL_PAGES, *extra]


def serve_cmd_defaults(port: int, *extra: str) -> list[str]:
    """serve_cmd on the default pages (2 MiB pages for the KV cache and the weights where the OS gives them)."""
    return [a for a in serve_cmd(port, *extra) if a not in SMALL_PAGES]


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """The server's output goes to an unnamed file, not a pipe: nobody reads a pipe while the test runs, and a
    full one (64 KiB of log) would block the server's next write, and with it every request."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by server_proc, which owns the process)
    small = SMALL_PAGES_ENV if SMALL_PAGES[0] in cmd else {}  # the weights' pages follow the KV cache's
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
                                 **small, **(env or {})})
    proc.log = log  # type: ignore[attr-defined]
    return proc


def server_log(proc: subprocess.Popen) -> str:
    """Everything the server wrote so far (stdout and stderr)."""
    log = proc.log  # type: ignore[attr-defined]
    log.seek(0)
    return log.read().decode("utf-8", "replace")


def wait_up(proc: subprocess.Popen, port: int, key: str | None = None) -> None:
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {server_log(proc)}")
        try:
            status, _ = request(port, "GET", "/health", key=key)
            if status == 200:
                return
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError("server did not come up in 120 s")
        time.sleep(0.2)


@contextmanager
def server(*extra: str, env: dict[str, str] | None = None, huge_pages: bool = False) -> Iterator[int]:
    with server_proc(serve_cmd_defaults if huge_pages else serve_cmd, *extra, env=env) as (port, _):
        yield port


@contextmanager
def template_server(directory: Path, template: str, *extra: str) -> Iterator[int]:
    """A server (with the test key) whose chat template is ``template``, written to a file in ``directory`` as
    --chat-template takes it."""
    path = directory / "chat.jinja"
    path.write_text(template)
    with server("--api-key", KEY, "--chat-template", str(path), *extra) as port:
        yield port


@contextmanager
def server_proc(cmd_for: Callable[..., list[str]], *extra: str, env: dict[str, str] | None = None,
                key: str | None = KEY) -> Iterator[tuple[int, subprocess.Popen]]:
    """A server process from ``cmd_for(port, *extra)``, up and healthy; terminated (if still running) after."""
    port = free_port()
    proc = start(cmd_for(port, *extra), env)
    try:
        wait_up(proc, port, key)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.log.close()  # type: ignore[attr-defined]


def request(port: int, method: str, path: str, body: bytes | str | dict | None = None,
            key: str | None = KEY) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body) if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(raw)
    except json.JSONDecodeError:
        return resp.status, raw


def metric(port: int, name: str) -> float:
    _, text = request(port, "GET", "/metrics")
    assert isinstance(text, str)
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def stream_raw(port: int, path: str, body: dict) -> tuple[socket.socket, bytes]:
    """Open a streamed request on a raw socket and read until the first event arrives."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while b"data:" not in got:
        chunk = s.recv(65536)
        assert chunk, "server closed the stream"
        got += chunk
    return s, got


def wait_idle(port: int, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(port, "kvpage:kv_cache_blocks_used") == 0 and metric(port, "kvpage:num_requests_running") == 0 \
                and metric(port, "kvpage:num_requests_waiting") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"not idle after {timeout} s: blocks {metric(port, 'kvpage:kv_cache_blocks_used')}, "
                         f"running {metric(port, 'kvpage:num_requests_running')}")




def raw_call(port: int, method: str, path: str, headers: dict[str, str],
             body: str | None = None) -> tuple[int, dict[str, str]]:
    """(status, response headers with lower-case names) of one request sent with exactly ``headers``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}

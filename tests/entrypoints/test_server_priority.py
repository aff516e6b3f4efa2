"""A request's priority over HTTP (vLLM's field): honoured by a server on --scheduling-policy priority, refused
by name by one that serves first come, first served."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers.server_util import metric, request, server, stream_raw, wait_idle

pytest.importorskip("fastapi")


def test_waiting_requests_run_in_priority_order():
    with server("--max-num-seqs", "1", "--scheduling-policy", "priority") as port:
        first, _ = stream_raw(port, "/v1/completions", {"prompt": "A long story", "max_tokens": 300,
                                                         "ignore_eos": True, "stream": True})
        finished: list[str] = []

        def send(name: str, priority: int) -> None:
            status, _ = request(port, "POST", "/v1/completions",
                                {"prompt": f"request {name}", "max_tokens": 2, "priority": priority})
            assert status == 200
            finished.append(name)

        threads = []
        for name, priority in (("late-in-line", 5), ("urgent", -5)):  # sent in this order
            threads.append(threading.Thread(target=send, args=(name, priority)))
            threads[-1].start()
            deadline = time.time() + 10
            while metric(port, "kvpage:num_requests_waiting") < len(threads) and time.time() < deadline:
                time.sleep(0.05)
        assert metric(port, "kvpage:num_requests_waiting") == 2
        first.close()  # the slot frees: the waiting requests run one at a time, the lower priority value first
        for t in threads:
            t.join(timeout=60)
        assert finished == ["urgent", "late-in-line"]
        wait_idle(port)


def test_a_fcfs_server_refuses_a_priority_by_name():
    with server() as port:
        status, err = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": 1})
        assert status == 400 and err["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in err["error"]["message"]
        assert request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": 0})[0] == 200
        wait_idle(port)

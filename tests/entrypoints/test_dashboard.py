"""The live KV dashboard of `kvpage serve` and its replays: the routes and their key rule, the snapshot's
agreement with the engine, the page in headless Chromium under load (its numbers against /metrics, no console
errors), and the trace / simulate replays stepped through end to end."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers.browser import CHROMIUM
from tests.helpers.server_util import KEY, metric, request, server

pytest.importorskip("fastapi")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (sh scripts/browser.sh)")


@pytest.fixture(scope="module")
def srv():
    with server("--api-key", KEY, "--max-num-seqs", "16") as port:
        yield port


def test_routes_keep_the_key_rule(srv):
    assert request(srv, "GET", "/dashboard", key=None)[0] == 401
    assert request(srv, "GET", "/dashboard/snapshot", key=None)[0] == 401
    assert request(srv, "GET", f"/dashboard?key={KEY}x", key=None)[0] == 401
    status, html = request(srv, "GET", f"/dashboard?key={KEY}", key=None)
    assert status == 200 and "<canvas" in html and "http" not in html.split("<script>")[1].split("fetch(")[0]
    status, snap = request(srv, "GET", "/dashboard/snapshot")
    assert status == 200
    pool, stats = snap["pool"], snap["stats"]
    assert len(pool["state"]) == pool["num_blocks"] == stats["kv_blocks_total"]
    assert pool["counts"]["used"] + pool["counts"]["shared"] == stats["kv_blocks_used"]
    assert isinstance(snap["history"], list)


def _load(port: int, stop: threading.Event) -> None:
    """One long request: while the six of them decode, the running count holds still (a count that changes
    between two polls of /metrics could be missed by them, and the page would seem wrong). Long enough to
    outlast the first of the page's checks, short enough that the server's drain at the end is quick."""
    request(port, "POST", "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time",
                                              "max_tokens": 200, "temperature": 1.0, "ignore_eos": True})


@needs_chromium
def test_live_page_shows_what_metrics_say(srv, tmp_path):
    from tests.helpers.browser import Browser

    stop = threading.Event()
    workers = [threading.Thread(target=_load, args=(srv, stop), daemon=True) for _ in range(6)]
    samples: list[tuple[float, float, float]] = []  # (time, running, blocks used) from /metrics

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time(), metric(srv, "kvpage:num_requests_running"),
                            metric(srv, "kvpage:kv_cache_blocks_used")))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    browser = Browser()
    try:
        # the page first, then the load: six requests of 200 tokens end in a few seconds on a fast machine,
        # less than the browser can take to start on a loaded one
        browser.open(f"http://127.0.0.1:{srv}/dashboard?key={KEY}")
        browser.wait_for("document.getElementById('v-blocks-total').textContent !== '-'")
        # /metrics is sampled from before the load starts: on a loaded machine the page's first read can show a
        # count from an update made while the last requests were still arriving, which the samples must cover
        sampler.start()
        for w in workers:
            w.start()
        deadline = time.time() + 30
        while metric(srv, "kvpage:num_requests_running") < len(workers) and time.time() < deadline:
            time.sleep(0.1)
        checks = 0
        for _ in range(6):
            time.sleep(0.4)
            t0 = time.time()
            running = int(browser.eval("document.getElementById('v-running').textContent"))
            used = int(browser.eval("document.getElementById('v-blocks-used').textContent"))
            t1 = time.time()  # the reads happened between t0 and t1 (a loaded machine's browser can take a while)
            time.sleep(0.4)
            # an update is 0.25 s: the page's figures are what /metrics said within one update of the read
            # (blocks in use change every few steps, faster than /metrics can be polled: within their range)
            near = [s for s in samples if t0 - 0.6 <= s[0] <= t1 + 0.6]
            assert any(s[1] == running for s in near), (running, near)
            assert min(s[2] for s in near) <= used <= max(s[2] for s in near), (used, near)
            if running > 0 and not checks:  # while the load runs (six requests of 200 tokens end in seconds)
                rows = browser.eval("document.querySelectorAll('#req-body tr').length")
                assert rows >= 1
                browser.eval("document.querySelector('#req-body tr').click()")  # pin a request's table
                assert browser.eval("document.querySelector('#req-body tr.pinned') !== null")
            checks += running > 0
        assert checks, "the page never showed a running request under load"
        assert not browser.errors, browser.errors
    finally:
        stop.set()
        browser.close()


@needs_chromium
@pytest.mark.slow
def test_replays_step_through_every_step(tmp_path):
    from kvpage.entrypoints.cli import main
    from tests.helpers.browser import Browser

    trace, sim = tmp_path / "trace.html", tmp_path / "sim.html"
    assert main(["trace", "--html", str(trace)]) == 0
    assert main(["simulate", "--num-requests", "40", "--kv-memory", "48MiB", "--html", str(sim)]) == 0
    browser = Browser()
    try:
        for path, panels in ((trace, 1), (sim, 2)):
            browser.open(path.as_uri())
            browser.wait_for("document.getElementById('step-label').textContent.startsWith('step 1 of')")
            n = browser.eval("+document.getElementById('slider').max + 1")
            assert n > 1
            for i in range(n):
                browser.eval(f"window.kvpageShow({i})")
                label = browser.eval("document.getElementById('step-label').textContent")
                assert label.startswith(f"step {i + 1} of {n}")
            assert browser.eval("document.querySelectorAll('#grids canvas.grid:not(.hostgrid)').length") == panels
            assert not browser.errors, (path.name, browser.errors)
        # the trace's last step: every sequence finished, every block back
        browser.open(trace.as_uri())
        browser.eval("window.kvpageShow(+document.getElementById('slider').max)")
        assert browser.eval("document.getElementById('v-blocks-used').textContent") == "0"
        assert browser.eval("getComputedStyle(document.getElementById('by-group-box')).display") == "none"
        # Gemma 3's six KV groups: the pool coloured by group, each group's blocks counted in the legend
        gemma = tmp_path / "gemma.html"
        assert main(["simulate", "--model", "gemma-3-270m", "--num-requests", "20", "--kv-memory", "48MiB",
                     "--html", str(gemma)]) == 0
        browser.open(gemma.as_uri())
        browser.wait_for("document.getElementById('step-label').textContent.startsWith('step 1 of')")
        browser.eval("window.kvpageShow(Math.floor(+document.getElementById('slider').max / 2))")
        browser.eval("document.getElementById('by-group').click()")
        legend = browser.eval("document.getElementById('group-legend').textContent")
        assert legend.count("group ") == 6 and "(full)" in legend and "(sliding(512))" in legend
        assert not browser.errors, browser.errors
    finally:
        browser.close()

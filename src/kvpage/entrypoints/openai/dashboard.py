"""The live KV dashboard of `kvpage serve`: one page (served by kvpage itself, no build step, no CDN), a JSON
snapshot of the block pool, and a server-sent event stream of snapshots while someone watches.

Cost when nobody watches: one dict of numbers appended per second to a bounded history (from the stats the
server already publishes after every step). While someone watches, the stream takes at most one snapshot per
``interval`` on the engine thread between two steps, shared by every viewer (benchmarks/dashboard.py measures
a snapshot's cost).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections import deque
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from kvpage.entrypoints.openai.engine_client import AsyncEngine
from kvpage.entrypoints.openai.protocol import APIError
from kvpage.sim.replay import page_html

# the per-second series the page plots (keys of the engine's stats)
SERIES = ("running", "waiting", "swapped", "kv_blocks_used", "kv_utilization", "kv_tail_waste_slots",
          "kv_reserved_unused_slots", "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "preemptions",
          "swap_preemptions", "kv_blocks_swapped_out", "kv_blocks_swapped_in")


class Dashboard:
    def __init__(self, client: AsyncEngine, model_name: str, interval: float = 0.25, history_seconds: int = 600):
        self.client = client
        self.model_name = model_name
        self.interval = interval
        self.history: deque[dict[str, float]] = deque(maxlen=history_seconds)
        self._last_sample = 0.0
        self._latest: dict[str, Any] | None = None
        self._taken = 0.0
        self._lock = asyncio.Lock()
        self.viewers = 0

    def record(self, stats: dict[str, Any]) -> None:
        """After a step (engine thread): one sample per second into the history."""
        now = time.time()
        if now - self._last_sample < 1.0:
            return
        self._last_sample = now
        self.history.append({"t": now, **{k: stats.get(k, 0) for k in SERIES}})

    async def snapshot(self) -> dict[str, Any]:
        """The newest frame, taken on the engine thread at most once per ``interval`` for every viewer."""
        async with self._lock:
            if self._latest is None or time.monotonic() - self._taken >= self.interval:
                frame = await self.client.call(lambda eng: eng.pool_snapshot())
                frame["model"] = self.model_name
                frame["history"] = list(self.history)
                self._latest, self._taken = frame, time.monotonic()
            return {**self._latest, "paused": self.client.paused}  # as of now, not of the frame

    async def events(self, request: Request):
        """Frames until the viewer leaves, the server drains for shutdown or the engine dies."""
        self.viewers += 1
        try:
            while self.client.draining is None and not await request.is_disconnected():
                try:
                    frame = await self.snapshot()
                except Exception as e:  # the engine died: say so and end the stream
                    yield f"event: error\ndata: {json.dumps({'error': str(e)})}\n\n"
                    return
                yield f"data: {json.dumps(frame, separators=(',', ':'))}\n\n"
                await asyncio.sleep(self.interval)
        finally:
            self.viewers -= 1


def install(app: FastAPI, client: AsyncEngine, model_name: str, api_key: str | None) -> Dashboard:
    """GET /dashboard (the page), /dashboard/snapshot (JSON), /dashboard/events (SSE). With an API key, the
    key comes as the usual Bearer header or, for a browser opening the page, as ``?key=``."""
    dash = Dashboard(client, model_name)
    prev = client.on_step

    def on_step(c: AsyncEngine, outs: list, seconds: float) -> None:
        if prev is not None:
            prev(c, outs, seconds)
        dash.record(c.stats)

    client.on_step = on_step

    def auth(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.startswith("Bearer ") else request.query_params.get("key", "")
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode()):
            raise APIError(401, "the dashboard needs the API key: an 'Authorization: Bearer' header or ?key=",
                           "authentication_error", code="invalid_api_key")

    @app.get("/dashboard")
    async def dashboard_page(request: Request) -> Response:
        auth(request)
        return HTMLResponse(page_html(title=f"kvpage: {model_name}"))

    @app.get("/dashboard/snapshot")
    async def dashboard_snapshot(request: Request) -> Response:
        auth(request)
        return JSONResponse(await dash.snapshot())

    @app.get("/dashboard/events")
    async def dashboard_events(request: Request) -> Response:
        auth(request)
        return StreamingResponse(dash.events(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return dash

"""Keep-alive beats on server-sent event streams that have been silent for a while (``--sse-keep-alive-interval``).

Why: a streamed request can stay silent for a long time before its first token (queued behind others, a
long prompt's prefill) or between tokens (preempted, frozen by ``/pause?mode=keep``), and the proxies in front
of a server close connections idle for 60 s (nginx, AWS ALB) or 120 s (Cloudflare) by default: the client then
sees a broken stream from a request that was fine. One timer around every event stream covers all of those
cases without touching the routes: an SSE comment (``: keep-alive``, which every SSE parser skips) on OpenAI's
streams, and Anthropic's own ``ping`` event on /v1/messages, whose clients expect that. The beat goes out
between two whole events (each event is one body message), never inside one. A request that a pause holds
before it reaches the engine has no response yet, so nothing to beat on. vLLM's server has the same flag (off
by default there too).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

COMMENT = b": keep-alive\n\n"
ANTHROPIC_PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def beat_for(path: str) -> bytes:
    return ANTHROPIC_PING if path.startswith("/v1/messages") else COMMENT


class SSEKeepAlive:
    """ASGI middleware: an event stream's response gets a beat whenever nothing was sent for ``interval`` seconds,
    until its last body message; other responses pass through untouched."""

    def __init__(self, app: Any, interval: float) -> None:
        self.app, self.interval = app, interval

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.interval <= 0:
            await self.app(scope, receive, send)
            return
        lock = asyncio.Lock()
        last = time.monotonic()
        done = False
        beater: asyncio.Task | None = None

        async def beats() -> None:
            nonlocal last
            beat = beat_for(scope.get("path", ""))
            while not done:
                await asyncio.sleep(max(0.0, last + self.interval - time.monotonic()))
                async with lock:
                    if done or time.monotonic() - last < self.interval:
                        continue
                    try:
                        await send({"type": "http.response.body", "body": beat, "more_body": True})
                    except Exception:  # the client is gone: the route notices on its own
                        return
                    last = time.monotonic()

        async def sending(message: dict) -> None:
            nonlocal last, done, beater
            async with lock:
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    done = True
                await send(message)
                last = time.monotonic()
            if message["type"] == "http.response.start" and _is_event_stream(message):
                beater = asyncio.create_task(beats())

        try:
            await self.app(scope, receive, sending)
        finally:
            done = True
            if beater is not None:  # not awaited: a cancelled request must not wait here (the loop runs it out)
                beater.cancel()


def _is_event_stream(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.split(b";")[0].strip() == b"text/event-stream"
               for k, v in start.get("headers", []))

"""How the server process lives and ends: graceful shutdown on SIGTERM/SIGINT, exit on a dead engine, and a
deadline for clients that never finish sending their request headers.

Shutdown: the first signal stops admissions (the listening socket closes; requests on open connections get
503), lets open requests run for up to ``shutdown_timeout`` seconds, then fails what is left (an error event
and [DONE] for a stream, a 503 otherwise) and exits 0 once every response is out. A second signal exits at
once. A dead engine fails every request at once and the process exits 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpage.entrypoints.openai.engine_client import AsyncEngine

logger = logging.getLogger(__name__)


class InflightCounter:
    """ASGI middleware counting the HTTP requests whose response is not finished yet (streams included)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.count = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """h11 protocol that closes a connection whose request headers are not complete ``seconds`` after it
    opened or after its previous response (uvicorn itself waits forever for a slow client's headers)."""

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._on_header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                logger.info("closing a connection whose request headers did not arrive within %.0f s", seconds)
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the headers are in; the body has its own deadline (read_body)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol


class KVServer(uvicorn.Server):
    """uvicorn with kvpage's shutdown: drain on the first signal, exit at once on the second, exit 1 when the
    engine dies. ``exit_code`` is what the process should return."""

    def __init__(self, config: uvicorn.Config, client: AsyncEngine, inflight: InflightCounter,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.client = client
        self.inflight = inflight
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._ending: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.on_fatal = self._engine_died
        await super().serve(sockets)

    # ------------------------------------------------------------ triggers
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            logger.warning("second %s: exiting at once", signal.Signals(sig).name)
            os._exit(128 + sig)
        logger.warning("%s: draining (up to %.0f s for open requests)", signal.Signals(sig).name,
                       self.shutdown_timeout)
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin, "the server is shutting down", self.shutdown_timeout, 0)

    def _engine_died(self, error: str) -> None:
        """Engine thread: every request was already failed; leave with 1 once their responses are out."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin, f"engine dead: {error}", 0.0, 1)

    # -------------------------------------------------------------- ending
    def _begin(self, reason: str, grace: float, exit_code: int) -> None:
        self.exit_code = max(self.exit_code, exit_code)
        self.client.drain(reason)
        if not exit_code:  # a drain takes no new connections; a dead engine still answers /health with why
            for server in self.servers:
                server.close()
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._finish(reason, grace))

    async def _finish(self, reason: str, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._busy():
            left = self.client.num_open
            logger.warning("%d request(s) still open after %.0f s: failing them", left, grace)
            self.client.abort_all(f"{reason}: the request did not finish within the {grace:g} s grace period")
            deadline = time.monotonic() + 10.0  # their error responses go out
            while self._busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True

    def _busy(self) -> bool:
        return self.inflight.count > 0 or (self.client.alive and self.client.num_open > 0)

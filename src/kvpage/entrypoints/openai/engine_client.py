"""The engine behind the HTTP server: one thread owns the LLMEngine and steps it; asyncio handlers talk to it
through a command queue and receive RequestOutputs on per-request asyncio queues.

Only the engine thread touches the engine (and therefore the scheduler and the KV manager), so no lock is
needed around them; handlers see a snapshot of the engine's stats published after every step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpage.engine.llm_engine import LLMEngine
from kvpage.outputs import RequestOutput
from kvpage.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue allows."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped; the server cannot serve."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: Callable[[RequestOutput | BaseException], None]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Thread-stepped LLMEngine with an asyncio face: ``submit`` hands a request over; outputs arrive on a queue."""

    def __init__(self, engine: LLMEngine, max_queue: int | None = None,
                 on_step: Callable[[AsyncEngine, list[RequestOutput], float], None] | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step  # called in the engine thread after every step (metrics)
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        # Requests submitted, and applied by the engine thread as of the last published stats: the difference
        # is what the published "waiting" count does not include yet.
        self._submitted = 0
        self._applied = 0
        self._applied_at_publish = 0
        self._lock = threading.Lock()  # guards the counters and the published stats
        self.stats: dict[str, Any] = engine.stats()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="kvpage-engine", daemon=True)
        self._stopping = False
        self._thread.start()

    # ------------------------------------------------------------ handler side
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     outputs: asyncio.Queue, cache_salt: str | None = None) -> None:
        """Hand a request to the engine; returns once the engine accepted it (or raises why it did not:
        QueueFullError, EngineDeadError, ValueError). Its RequestOutputs, and an EngineDeadError if the engine
        dies, then arrive on ``outputs``, which several requests may share. The caller aborts what it leaves."""
        if not self.alive:
            raise EngineDeadError(self.error or "the engine thread is not running")
        loop = asyncio.get_running_loop()

        def sink(item: RequestOutput | BaseException) -> None:  # engine thread -> event loop
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        with self._lock:
            waiting = int(self.stats["waiting"]) + self._submitted - self._applied_at_publish
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFullError(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
            self._submitted += 1
        cmd = _Add(request_id, prompt_ids, params, cache_salt, sink)
        self._commands.put(cmd)
        try:
            await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may still be added: the abort follows it in the command queue
            raise

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------- engine side
    def _apply(self, cmd: _Add | _Abort) -> None:
        eng = self.engine
        if isinstance(cmd, _Abort):
            if cmd.request_id in eng.requests:
                eng.abort_request(cmd.request_id)
            return
        self._applied += 1
        try:
            eng.add_request(cmd.request_id, {"prompt_token_ids": cmd.prompt_ids}, cmd.params,
                            cache_salt=cmd.cache_salt)
        except Exception as e:  # refused: nothing was allocated
            cmd.done.set_exception(e)
            return
        self._sinks[cmd.request_id] = cmd.sink
        cmd.done.set_result(None)

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stopping:
                block = not eng.has_unfinished_requests()
                try:
                    cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                    while True:
                        if cmd is None:
                            return
                        self._apply(cmd)
                        cmd = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if not eng.has_unfinished_requests():
                    self._publish([], 0.0)
                    continue
                t0 = time.perf_counter()
                outs = eng.step()
                self._publish(outs, time.perf_counter() - t0)
                for out in outs:
                    sink = self._sinks.get(out.request_id)
                    if sink is None:
                        continue
                    sink(out)
                    if out.finished:
                        del self._sinks[out.request_id]
        except Exception as e:  # a bug: fail every open request loudly rather than hang them
            logger.exception("engine thread failed")
            self.error = f"engine thread failed: {type(e).__name__}: {e}"
            for sink in self._sinks.values():
                sink(EngineDeadError(self.error))
            self._sinks.clear()

    def _publish(self, outs: list[RequestOutput], step_seconds: float) -> None:
        stats = self.engine.stats()
        with self._lock:
            self.stats = stats
            self._applied_at_publish = self._applied
        if self.on_step is not None and (outs or step_seconds):
            self.on_step(self, outs, step_seconds)

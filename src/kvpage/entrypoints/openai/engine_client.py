"""The engine behind the HTTP server: one thread owns the LLMEngine and steps it; asyncio handlers talk to it
through a command queue and receive RequestOutputs on per-request asyncio queues.

Only the engine thread touches the engine (and therefore the scheduler and the KV manager), so no lock is
needed around them; handlers see a snapshot of the engine's stats published after every step.

Given a factory, the engine thread also builds the engine, so that every OpenMP parallel region of the
process runs on that one thread: libgomp counts the threads of every team a thread ever opened, and once
they outnumber the cores its workers stop spin-waiting between regions. Building the engine on the main
thread and stepping it on another made every model step 17% slower (AMX Xeon, 2 cores; benchmarks/online.py).

Every submission resolves: accepted, refused (queue full, draining, engine dead, bad request), or, once
accepted, finished, failed or aborted. If the engine dies, every open and queued request gets an
EngineDeadError at once and ``on_fatal`` tells the server to exit.

Generation can be paused (vLLM's POST /pause): new submissions are then held, not refused, and reach the engine
in order on resume; the open requests are aborted ("abort"), run to their end ("wait") or stay where they are
with their KV blocks until resume ("keep").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpage.engine.llm_engine import LLMEngine
from kvpage.entrypoints.openai.engine_commands import (
    PAUSE_MODES,
    Abort,
    AbortAll,
    Add,
    Call,
    Command,
    Pause,
    Resume,
    settle,
)
from kvpage.errors import EngineDeadError, QueueFullError, ShuttingDownError
from kvpage.outputs import RequestOutput
from kvpage.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["PAUSE_MODES", "AsyncEngine", "EngineDeadError", "QueueFullError", "ShuttingDownError"]


Item = RequestOutput | BaseException

# While requests run, the engine's full stats (they walk every block table) are taken after a step at most this
# often and the O(1) ones (LLMEngine.live_stats) after every step; all of them whenever the engine is idle.
FULL_STATS_SECONDS = 0.5
# Freed heap goes back to the OS once the engine has had nothing to do for this long after a busy spell
# (LLMEngine.release_idle_memory: 17-40 ms of malloc_trim after 64 requests, AMX Xeon), so that a client that
# sends its next request right after the last reply does not wait behind it.
IDLE_TRIM_SECONDS = 1.0


def _deliver(items: list[tuple[asyncio.Queue, Item]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    """Thread-stepped LLMEngine with an asyncio face: ``submit`` hands a request over; outputs arrive on a queue."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_queue: int | None = None,
                 on_step: Callable[[AsyncEngine, list[RequestOutput], float], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.max_queue = max_queue
        self.on_step = on_step  # called in the engine thread after every step (metrics)
        self.on_fatal = on_fatal  # called once, in the engine thread, when the engine dies
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Requests submitted, and applied by the engine thread as of the last published stats: the difference
        # is what the published "waiting" count does not include yet.
        self._submitted = 0
        self._applied = 0
        self._applied_at_publish = 0
        self._full_stats_at = 0.0  # time.monotonic() of the last full stats
        self._lock = threading.Lock()  # guards the counters, the published stats and the admission state
        self.error: str | None = None
        self.draining: str | None = None  # why new requests are refused (set by ``drain``)
        self._stopping = False
        # Pause state, written by the engine thread alone: submissions held while paused (applied on resume), no
        # step while frozen ("keep"), and the pauses that return once nothing is open ("wait", "abort").
        self.paused = False
        self._frozen = False
        self._held: list[Add] = []
        self._until_idle: list[Pause] = []
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="kvpage-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()  # the factory's exception, if it raised
        self.stats: dict[str, Any] = self.engine.stats()

    # ------------------------------------------------------------ handler side
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_open(self) -> int:
        """Requests accepted and not yet finished, plus submissions the engine has not applied."""
        with self._lock:
            return int(self.stats["running"]) + int(self.stats["waiting"]) + int(self.stats["swapped"]) + \
                self._submitted - self._applied_at_publish

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     outputs: asyncio.Queue, cache_salt: str | None = None, priority: int = 0) -> None:
        """Hand a request to the engine; returns once the engine accepted it (or raises why it did not:
        QueueFullError, ShuttingDownError, EngineDeadError, ValueError). Its RequestOutputs, and an
        EngineDeadError if the engine dies, then arrive on ``outputs``, which several requests may share.
        The caller aborts what it leaves."""
        cmd = Add(request_id, prompt_ids, params, cache_salt, asyncio.get_running_loop(), outputs, priority)
        with self._lock:  # the engine thread fails queued commands under the same lock when it dies
            if self.error is not None or not self._thread.is_alive():
                raise EngineDeadError(self.error or "the engine thread is not running")
            if self.draining is not None:
                raise ShuttingDownError(self.draining)
            waiting = int(self.stats["waiting"]) + self._submitted - self._applied_at_publish
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFullError(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
            self._submitted += 1
            self._commands.put(cmd)
        try:
            await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may still be added: the abort follows it in the command queue
            raise

    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps; its result (or exception)."""
        return await self._command(Call(fn))

    async def pause(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """Pause generation: new requests are held until ``resume``; the open ones are aborted (they finish with
        reason "abort"), run to their end, or frozen with their blocks ("abort" / "wait" / "keep"). Returns
        once nothing runs any more (at once for "keep"); ``clear_cache`` then forgets the prefix cache."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self._command(Pause(mode, clear_cache))

    async def resume(self) -> None:
        """Go on after a pause: held requests reach the engine in the order they came, frozen ones run again."""
        await self._command(Resume())

    async def _command(self, cmd: Call | Pause | Resume) -> Any:
        """Hand ``cmd`` to the engine thread and await what it resolves it with."""
        with self._lock:
            if self.error is not None or not self._thread.is_alive():
                raise EngineDeadError(self.error or "the engine thread is not running")
            self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    def drain(self, reason: str) -> None:
        """Refuse new requests from now on (open ones go on)."""
        with self._lock:
            self.draining = reason

    def abort_all(self, reason: str) -> None:
        """Fail every open request with ``reason`` (their blocks return at the engine's next iteration)."""
        self._commands.put(AbortAll(reason))

    def shutdown(self) -> None:
        self.drain("the server is shutting down")
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------- engine side
    def _apply(self, cmd: Command) -> None:
        eng = self.engine
        if isinstance(cmd, Pause | Resume):
            if isinstance(cmd, Pause):
                self._pause(cmd)
            else:
                self._resume(cmd)
            return
        if isinstance(cmd, Add) and self.paused:
            self._held.append(cmd)
            return
        if isinstance(cmd, Call):
            try:
                settle(cmd.done, cmd.fn(eng))
            except Exception as e:
                settle(cmd.done, error=e)
            return
        if isinstance(cmd, Abort):
            if cmd.request_id in eng.requests:
                eng.abort_request(cmd.request_id)
            self._release_held(lambda add: add.request_id == cmd.request_id, None)
            return
        if isinstance(cmd, AbortAll):  # each handler hears why; the engine frees the blocks
            error = ShuttingDownError(cmd.reason)
            self._release_held(lambda add: True, error)
            batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Item]]] = {}
            for loop, q in self._sinks.values():
                batches.setdefault(loop, []).append((q, error))
            self._sinks.clear()
            eng.abort_request(list(eng.requests))
            self._post(batches)
            return
        self._applied += 1
        try:
            eng.add_request(cmd.request_id, {"prompt_token_ids": cmd.prompt_ids}, cmd.params,
                            priority=cmd.priority, cache_salt=cmd.cache_salt)
        except Exception as e:  # refused: nothing was allocated
            settle(cmd.done, error=e)
            return
        self._sinks[cmd.request_id] = (cmd.loop, cmd.outputs)
        settle(cmd.done)  # a sender that withdrew meanwhile sent an abort, which follows

    def _pause(self, cmd: Pause) -> None:
        eng = self.engine
        self.paused = True
        self._frozen = cmd.mode == "keep"
        if cmd.mode == "keep":  # an earlier pause still waiting for open requests returns too: they are frozen
            for p in [*self._until_idle, cmd]:
                settle(p.done)
            self._until_idle = []
            return
        if cmd.mode == "abort" and eng.has_unfinished_requests():
            eng.abort_request(list(eng.requests))
            outs = eng.step()  # nothing is scheduled: it reports the aborted requests, finish reason "abort"
            self._publish(outs, 0.0)
            self._send(outs)
        self._until_idle.append(cmd)
        self._end_pauses_if_idle()

    def _end_pauses_if_idle(self) -> None:
        """The pauses waiting for the open requests to end, returned once none is left."""
        if not self._until_idle or self.engine.has_unfinished_requests():
            return
        waiting, self._until_idle = self._until_idle, []
        cleared = any(p.clear_cache for p in waiting)
        for p in waiting:
            try:
                if cleared:
                    self.engine.reset_prefix_cache()
                    cleared = False
                settle(p.done)
            except Exception as e:
                settle(p.done, error=e)

    def _resume(self, cmd: Resume) -> None:
        self.paused = self._frozen = False
        held, self._held = self._held, []
        for add in held:
            self._apply(add)
        for p in self._until_idle:  # a pause still waiting for open requests is overtaken: it returns
            settle(p.done)
        self._until_idle = []
        settle(cmd.done)

    def _release_held(self, which: Callable[[Add], bool], error: BaseException | None) -> None:
        """Drop held submissions (an abort, a shutdown): their senders hear ``error`` (none: nobody waits)."""
        keep = []
        for add in self._held:
            if not which(add):
                keep.append(add)
                continue
            self._applied += 1  # it will never be applied: the waiting count must not keep it
            settle(add.done, error=error or ShuttingDownError("the request was withdrawn"))
        self._held = keep

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            built.set_result(engine if hasattr(engine, "step") else engine())  # an engine, or its factory
        except BaseException as e:
            built.set_exception(e)
            return
        self.engine = built.result()
        with self._lock:
            self.stats = self.engine.stats()
        self._loop()

    def _loop(self) -> None:
        eng = self.engine
        last_step: float | None = None  # when the last step ran, None once memory was handed back after it
        try:
            while not self._stopping:
                block = self._frozen or not eng.has_unfinished_requests()
                try:
                    cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                    while True:
                        if cmd is None:
                            return
                        self._apply(cmd)
                        cmd = self._commands.get_nowait()
                except queue.Empty:
                    pass
                self._end_pauses_if_idle()
                if self._frozen or not eng.has_unfinished_requests():
                    self._publish([], 0.0)
                    if (last_step is not None and not eng.has_unfinished_requests()  # once per idle spell,
                            and time.monotonic() - last_step >= IDLE_TRIM_SECONDS):  # not while paused
                        eng.release_idle_memory()
                        last_step = None
                    if (error := eng.check_health()) is not None:  # a rank lost while idle: dead now
                        self._die(error)
                        return
                    continue
                t0 = time.perf_counter()
                outs = eng.step()
                last_step = time.monotonic()
                self._publish(outs, time.perf_counter() - t0)
                self._send(outs)
                if eng.fatal_error is not None:
                    self._die(eng.fatal_error)
                    return
        except Exception as e:  # a bug in a step: nothing about the engine's state can be trusted
            logger.exception("engine thread failed")
            self._die(f"engine thread failed: {type(e).__name__}: {e}")
        finally:
            self._close()

    def _send(self, outs: list[RequestOutput]) -> None:
        """Hand the step's outputs to their handlers: one thread hop per event loop, not per request."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Item]]] = {}
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            batches.setdefault(sink[0], []).append((sink[1], out))
            if out.finished:
                del self._sinks[out.request_id]
        self._post(batches)

    @staticmethod
    def _post(batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Item]]]) -> None:
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(_deliver, items)

    def _die(self, error: str) -> None:
        """Fail everything open and queued, at once, and tell the server."""
        logger.error("engine dead: %s", error)
        with self._lock:
            self.error = error
        self._close()
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:
                logger.exception("on_fatal failed")

    def _close(self) -> None:
        """Resolve every submission still open: queued commands and accepted requests get EngineDeadError."""
        error = EngineDeadError(self.error or "the engine stopped")
        with self._lock:
            if self.error is None:
                self.error = str(error)
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        pending += self._held + self._until_idle
        self._held, self._until_idle = [], []
        for cmd in pending:
            if isinstance(cmd, Add | Call | Pause | Resume):
                settle(cmd.done, error=error)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Item]]] = {}
        for loop, q in self._sinks.values():
            batches.setdefault(loop, []).append((q, error))
        self._sinks.clear()
        self._post(batches)

    def _publish(self, outs: list[RequestOutput], step_seconds: float) -> None:
        now = time.monotonic()
        if now - self._full_stats_at >= FULL_STATS_SECONDS or not self.engine.has_unfinished_requests():
            stats = self.engine.stats()
            self._full_stats_at = now
        else:  # the walk's figures as of the last full stats, the rest fresh (this thread alone writes them)
            stats = {**self.stats, **self.engine.live_stats()}
        with self._lock:
            self.stats = stats
            self._applied_at_publish = self._applied
        if self.on_step is not None and (outs or step_seconds):
            try:
                self.on_step(self, outs, step_seconds)
            except Exception:  # metrics must never take the engine down
                logger.exception("metrics update failed")

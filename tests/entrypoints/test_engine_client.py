"""The server's engine client on a stand-in engine: every submission resolves, whatever the engine does."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvpage.entrypoints.openai.engine_client import (
    FULL_STATS_SECONDS,
    AsyncEngine,
    EngineDeadError,
    ShuttingDownError,
)
from kvpage.outputs import CompletionOutput, RequestOutput
from kvpage.sampling_params import SamplingParams


class StandInEngine:
    """Enough of LLMEngine for AsyncEngine: requests finish after ``steps`` steps; ``fail_at`` makes a step
    raise (a bug in a step) once that many steps ran."""

    def __init__(self, steps: int = 3, fail_at: int | None = None, slow: threading.Event | None = None) -> None:
        self.requests: dict[str, int] = {}
        self.steps, self.fail_at, self.slow = steps, fail_at, slow
        self.ran = 0
        self.fatal_error: str | None = None
        self.aborted: list[str] = []

    def live_stats(self) -> dict[str, float]:
        return {"running": len(self.requests), "waiting": 0, "swapped": 0}

    def stats(self) -> dict[str, float]:
        return {**self.live_stats(), "steps_seen": self.ran}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id, prompt, params, priority=0, cache_salt=None) -> None:
        if not prompt["prompt_token_ids"]:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = 0

    def abort_request(self, ids) -> None:
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def step(self) -> list[RequestOutput]:
        if self.slow is not None:
            self.slow.wait(5)
        self.ran += 1
        if self.fail_at is not None and self.ran >= self.fail_at:
            raise RuntimeError("a bug in the step")
        outs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] >= self.steps
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [5], finish_reason="length" if done
                                                                        else None)], done))
            if done:
                del self.requests[rid]
        return outs


class CountingEngine(StandInEngine):
    """Counts full stats (the block tables' walk in LLMEngine) taken while a request runs."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps=steps)
        self.full_while_busy = 0

    def stats(self) -> dict[str, float]:
        self.full_while_busy += bool(self.requests)
        return super().stats()


async def follow(q: asyncio.Queue) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), 10)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def test_outputs_arrive_and_bad_requests_are_refused():
    async def main():
        client = AsyncEngine(StandInEngine())
        q: asyncio.Queue = asyncio.Queue()
        await client.submit("a", [1, 2], SamplingParams(), q)
        items = await follow(q)
        assert [i.finished for i in items] == [False, False, True]
        with pytest.raises(ValueError, match="empty"):
            await client.submit("b", [], SamplingParams(), asyncio.Queue())
        client.shutdown()

    asyncio.run(main())


def test_a_dying_engine_resolves_every_submission_and_says_why():
    fatal: list[str] = []
    told = threading.Event()

    def on_fatal(error: str) -> None:
        fatal.append(error)
        told.set()

    async def main():
        gate = threading.Event()
        client = AsyncEngine(StandInEngine(steps=100, fail_at=2, slow=gate), on_fatal=on_fatal)
        queues = [asyncio.Queue() for _ in range(8)]
        await client.submit("first", [1], SamplingParams(), queues[0])
        # more submissions race with the failing step: accepted or refused, none may hang
        submits = [asyncio.ensure_future(client.submit(f"r{i}", [1], SamplingParams(), queues[i]))
                   for i in range(1, 8)]
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*submits, return_exceptions=True), 10)
        streams = await asyncio.wait_for(asyncio.gather(
            *(follow(q) for q, r in zip(queues, [None, *results], strict=True) if r is None)), 10)
        for items in streams:
            assert isinstance(items[-1], EngineDeadError)
        assert all(r is None or isinstance(r, EngineDeadError) for r in results)
        assert not client.alive and "a bug in the step" in (client.error or "")
        with pytest.raises(EngineDeadError, match="a bug in the step"):
            await client.submit("late", [1], SamplingParams(), asyncio.Queue())

    asyncio.run(main())
    # the engine thread tells the server after failing the requests: the streams may end first
    assert told.wait(10)
    assert len(fatal) == 1 and "a bug in the step" in fatal[0]


def test_draining_refuses_new_work_and_abort_all_fails_open_requests():
    async def main():
        engine = StandInEngine(steps=10_000)
        client = AsyncEngine(engine)
        q: asyncio.Queue = asyncio.Queue()
        await client.submit("long", [1], SamplingParams(), q)
        client.drain("the server is shutting down")
        with pytest.raises(ShuttingDownError):
            await client.submit("new", [1], SamplingParams(), asyncio.Queue())
        client.abort_all("shutting down: grace period over")
        items = await follow(q)
        assert isinstance(items[-1], ShuttingDownError) and "grace period" in str(items[-1])
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["long"] and not engine.requests
        client.shutdown()

    asyncio.run(main())


def test_full_stats_are_taken_at_most_twice_a_second_while_busy_and_fresh_when_idle():
    """Steps much shorter than FULL_STATS_SECONDS publish the O(1) stats; the engine going idle publishes all."""
    async def main():
        eng = CountingEngine(steps=40)
        client = AsyncEngine(eng)
        q: asyncio.Queue = asyncio.Queue()
        t0 = time.monotonic()
        await client.submit("a", [1, 2], SamplingParams(), q)
        items = await follow(q)
        busy = time.monotonic() - t0
        assert len(items) == 40
        assert eng.full_while_busy <= 1 + busy / FULL_STATS_SECONDS
        for _ in range(100):  # the idle loop's publish
            if client.stats.get("steps_seen") == eng.ran:
                break
            await asyncio.sleep(0.02)
        assert client.stats["steps_seen"] == eng.ran == 40 and client.stats["running"] == 0
        client.shutdown()

    asyncio.run(main())

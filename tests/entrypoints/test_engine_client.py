"""The server's engine client on a stand-in engine: every submission resolves, whatever the engine does."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvpage.entrypoints.openai.engine_client import (
    FULL_STATS_SECONDS,
    IDLE_TRIM_SECONDS,
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
        self.reported: list[str] = []  # aborted, reported by the next step (as LLMEngine does)
        self.trims: list[int] = []  # steps run when the client handed idle memory back

    def live_stats(self) -> dict[str, float]:
        return {"running": len(self.requests), "waiting": 0, "swapped": 0}

    def stats(self) -> dict[str, float]:
        return {**self.live_stats(), "steps_seen": self.ran}

    def add_request(self, request_id, prompt, params, priority=0, cache_salt=None) -> None:
        if not prompt["prompt_token_ids"]:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = 0

    def abort_request(self, ids) -> None:
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)
                self.reported.append(rid)

    def check_health(self) -> str | None:
        return None

    def release_idle_memory(self) -> None:
        self.trims.append(self.ran)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.reported)

    def step(self) -> list[RequestOutput]:
        if self.slow is not None:
            self.slow.wait(5)
        self.ran += 1
        if self.fail_at is not None and self.ran >= self.fail_at:
            raise RuntimeError("a bug in the step")
        outs = [RequestOutput(rid, None, [1], [CompletionOutput(0, "", [], finish_reason="abort")], True)
                for rid in self.reported]
        self.reported = []
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
        with pytest.raises(EngineDeadError, match="a bug in the step"):  # the server answers these with 503
            await client.pause("keep")

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
        for _ in range(500):  # the engine thread steps a 10,000-step request flat out meanwhile
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


async def resolved(fut: asyncio.Future, within: float = 0.3) -> bool:
    """Whether ``fut`` resolves within ``within`` seconds (it keeps running if not)."""
    done, _ = await asyncio.wait([fut], timeout=within)
    return bool(done)


def test_pause_abort_ends_open_requests_and_holds_new_ones_until_resume():
    async def main():
        engine = StandInEngine(steps=10_000)
        client = AsyncEngine(engine)
        q: asyncio.Queue = asyncio.Queue()
        await client.submit("open", [1], SamplingParams(), q)
        await client.pause("abort")
        items = await follow(q)
        assert items[-1].finished and items[-1].outputs[0].finish_reason == "abort" and engine.aborted == ["open"]
        assert client.paused
        held_q: asyncio.Queue = asyncio.Queue()
        engine.steps = 3
        held = asyncio.ensure_future(client.submit("held", [1], SamplingParams(), held_q))
        assert not await resolved(held) and "held" not in engine.requests and client.num_open == 1
        await client.resume()
        await asyncio.wait_for(held, 5)
        assert not client.paused and [i.finished for i in await follow(held_q)] == [False, False, True]
        client.shutdown()

    asyncio.run(main())


def test_pause_wait_returns_once_open_requests_finish():
    async def main():
        gate = threading.Event()
        engine = StandInEngine(steps=3, slow=gate)
        client = AsyncEngine(engine)
        q: asyncio.Queue = asyncio.Queue()
        await client.submit("open", [1], SamplingParams(), q)
        pause = asyncio.ensure_future(client.pause("wait"))
        late = asyncio.ensure_future(client.submit("late", [1], SamplingParams(), asyncio.Queue()))
        assert not await resolved(pause, 0.1)  # the open request is still running
        gate.set()
        await asyncio.wait_for(pause, 5)
        assert [i.finished for i in await follow(q)] == [False, False, True] and not engine.aborted
        assert not await resolved(late) and not engine.requests  # held, not run
        await client.resume()
        await asyncio.wait_for(late, 5)
        client.shutdown()

    asyncio.run(main())


def test_pause_keep_freezes_open_requests_where_they_are():
    async def main():
        engine = StandInEngine(steps=10_000)
        client = AsyncEngine(engine)
        q: asyncio.Queue = asyncio.Queue()
        await client.submit("kept", [1], SamplingParams(), q)
        await client.pause("keep")
        ran = engine.ran
        await asyncio.sleep(0.2)
        assert engine.ran == ran and "kept" in engine.requests and not engine.aborted  # no step while frozen
        engine.steps = engine.requests["kept"] + 2
        await client.resume()
        items = await follow(q)
        assert items[-1].finished and items[-1].outputs[0].finish_reason == "length" and engine.ran > ran
        with pytest.raises(ValueError, match="mode must be one of"):
            await client.pause("sometimes")
        client.shutdown()

    asyncio.run(main())


def test_held_requests_are_dropped_when_withdrawn_and_failed_on_shutdown():
    async def main():
        engine = StandInEngine(steps=3)
        client = AsyncEngine(engine)
        await client.pause("keep")
        gone = asyncio.ensure_future(client.submit("gone", [1], SamplingParams(), asyncio.Queue()))
        kept = asyncio.ensure_future(client.submit("kept", [1], SamplingParams(), asyncio.Queue()))
        assert not await resolved(gone, 0.1)
        gone.cancel()  # the client went away while its request was held: it is dropped, never run
        with pytest.raises(asyncio.CancelledError):
            await gone
        for _ in range(100):
            if client.num_open == 1:
                break
            await asyncio.sleep(0.01)
        assert client.num_open == 1
        client.abort_all("the server is shutting down: grace period over")
        with pytest.raises(ShuttingDownError, match="grace period"):
            await asyncio.wait_for(kept, 5)
        await client.resume()
        assert not engine.requests and client.num_open == 0
        client.shutdown()

    asyncio.run(main())


def test_commands_withdrawn_before_the_engine_takes_them_leave_it_running():
    """A sender cancelled while its command waits for the step to end (a closed connection, a shutdown): the engine
    thread finds the command's future cancelled and must go on (resolving it raised and killed the thread)."""
    async def main():
        gate = threading.Event()
        engine = StandInEngine(steps=2, slow=gate)
        client = AsyncEngine(engine)
        q: asyncio.Queue = asyncio.Queue()
        await client.submit("busy", [1], SamplingParams(), q)  # the engine thread now sits in a slow step
        withdrawn = [asyncio.ensure_future(client.call(lambda eng: 1)),
                     asyncio.ensure_future(client.submit("gone", [1], SamplingParams(), asyncio.Queue())),
                     asyncio.ensure_future(client.pause("keep"))]
        await asyncio.sleep(0.05)
        for task in withdrawn:
            task.cancel()
        gate.set()
        assert await client.call(lambda eng: 2) == 2 and client.alive  # after the withdrawn ones, in order
        assert client.paused  # a withdrawn pause still took effect (its sender no longer hears so)
        await client.resume()
        await follow(q)
        await client.submit("next", [1], SamplingParams(), q)
        assert (await follow(q))[-1].finished and client.alive
        client.shutdown()

    asyncio.run(main())


def test_idle_memory_is_handed_back_once_per_idle_spell():
    """After the last request of a busy spell, once the engine has been idle for IDLE_TRIM_SECONDS, it frees its
    heap once (LLMEngine.release_idle_memory: every rank's malloc_trim); not before any step ran, not at once
    (a client's next request may be on its way), and not again while it stays idle."""
    async def until(cond, limit: float) -> None:
        deadline = time.monotonic() + limit
        while not cond() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def main():
        engine = StandInEngine(steps=3)
        client = AsyncEngine(engine)
        await asyncio.sleep(IDLE_TRIM_SECONDS + 0.7)  # idle from the start: nothing to hand back
        assert engine.trims == []
        for spell in range(2):
            queues = [asyncio.Queue() for _ in range(3)]
            for i, q in enumerate(queues):
                await client.submit(f"s{spell}-{i}", [1], SamplingParams(), q)
            await asyncio.gather(*(follow(q) for q in queues))
            ended = time.monotonic()
            await until(lambda n=spell: len(engine.trims) > n, IDLE_TRIM_SECONDS + 3)
            assert len(engine.trims) == spell + 1 and time.monotonic() - ended >= IDLE_TRIM_SECONDS - 0.1
        await asyncio.sleep(IDLE_TRIM_SECONDS + 0.7)
        assert len(engine.trims) == 2 and engine.trims[0] >= 3 and engine.trims[1] >= engine.trims[0] + 3
        client.shutdown()

    asyncio.run(main())

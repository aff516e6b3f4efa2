"""Helpers shared by the benchmark scripts (timing, driving an engine to completion)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def drive(engine, on_step: Callable[[], None] | None = None) -> tuple[int, float]:
    """Step ``engine`` until every request has finished; returns (generated tokens, seconds).
    ``on_step`` runs after each step (to sample KV statistics), inside the timed region."""
    tokens = 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        for ro in engine.step():
            if ro.finished:
                tokens += len(ro.outputs[0].token_ids)
        if on_step is not None:
            on_step()
    return tokens, time.perf_counter() - t

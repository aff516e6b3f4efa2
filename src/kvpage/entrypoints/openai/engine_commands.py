"""The commands the server's handlers send the engine thread (engine_client.AsyncEngine), each with the future its
sender awaits; the engine thread resolves them with ``settle``, which a sender that gave up (cancelled the
future: a closed connection, a shutdown) cannot turn into an exception on the engine thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpage.engine.llm_engine import LLMEngine

PAUSE_MODES = ("abort", "wait", "keep")  # what a pause does with the open requests


@dataclass
class Add:
    """A request to take; its outputs go to ``outputs`` on ``loop``; ``done`` says it was taken (or why not)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    priority: int = 0
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Abort:
    """Stop a request wherever it is (or drop it while a pause holds it)."""

    request_id: str


@dataclass
class AbortAll:
    """Fail every open and held request with ``reason`` (the end of a shutdown's grace period)."""

    reason: str


@dataclass
class Pause:
    """Hold new requests; ``mode`` (PAUSE_MODES) says what becomes of the open ones."""

    mode: str
    clear_cache: bool
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Resume:
    """End a pause: held requests are taken in order, kept ones run again."""

    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Call:
    """Run ``fn(engine)`` on the engine thread between steps (admin actions such as resetting the prefix cache)."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def settle(fut: concurrent.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve a command's future from the engine thread, unless its sender withdrew it (cancelled it) first: a
    withdrawn command must not take the engine thread down."""
    try:
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


Command = Add | Abort | AbortAll | Call | Pause | Resume

"""Stored responses for /v1/responses: what ``previous_response_id``, ``background`` and the retrieval routes
(GET / DELETE /v1/responses/{id}, POST .../cancel, GET .../input_items) need.

A stored response keeps its conversation (earlier turns, this input and this reply, without the instructions,
which OpenAI's API does not carry over to the next turn) so that a later request can continue it. The store
holds at most ``capacity`` responses and about ``max_bytes`` of their text (conversations, input items and a
background run's kept frames, counted as JSON text), dropping the oldest finished one first: a server that runs
for months keeps a bounded amount whatever its clients send (``kvpage serve --responses-store-size`` and
``--responses-store-memory``; a size of 0 keeps none). Running responses are never dropped. A background response
runs as a task that no client connection owns; its stream's events are kept, already serialized, so that a
client can follow it from any point (GET ?stream=true&starting_after=N) and a disconnect loses nothing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpage.entrypoints.openai.http_input import check_auth
from kvpage.entrypoints.openai.protocol import APIError

RUNNING = ("queued", "in_progress")
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as the API lists it back: one user message for plain text, and an id on every item."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        out.append({"id": item.get("id") or f"{_ITEM_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}",
                    **{k: v for k, v in item.items() if k != "id"}, "type": kind})
    return out


@dataclass
class StoredResponse:
    """One response: its current body (a function of the live shape, so a running response shows its output so
    far), the conversation a next turn continues, its input items, and for a background run its task and
    stream."""

    id: str
    shape: Any  # response_shape.ResponseShape: its status, and body() (the response object as it stands)
    before: list[dict[str, Any]]  # chat messages of the earlier turns
    inputs: list[dict[str, Any]]  # this request's input items, with ids
    background: bool = False
    conversation: list[dict[str, Any]] | None = None  # set once finished: before + this input + this reply
    task: asyncio.Task | None = None  # a background run
    stop: Callable[[], None] | None = None  # ends a background run: its engine request aborted, status cancelled
    frames: list[str] = field(default_factory=list)  # a background stream's SSE frames, in order
    ended: bool = False  # the background run is over and its last frame published
    nbytes: int = 0  # the text it keeps (frames, conversation, input items), as the store's budget counts it
    before_bytes: int = 0  # the earlier turns' share of that (the continued response's conversation_bytes)
    conversation_bytes: int = 0  # the conversation's share, once finished
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _owner: ResponseStore | None = None  # the store whose budget it counts against, while it is stored

    def grow(self, n: int, finished: bool = False) -> None:
        """Count ``n`` more bytes against the store's budget (which may drop older finished responses);
        ``finished``: this response has just finished (so the store has one it may drop)."""
        self.nbytes += n
        if self._owner is not None:
            self._owner.grew(n, finished)

    def settle(self, turn: list[dict[str, Any]]) -> None:
        """The finished conversation a next turn continues (the earlier turns, then ``turn``: this input and this
        reply), counted against the budget; only the new turn is measured (the earlier ones were, when stored)."""
        self.conversation = self.before + turn
        self.conversation_bytes = self.before_bytes + json_size(turn)
        self.grow(self.conversation_bytes, finished=True)

    @property
    def running(self) -> bool:
        return self.shape.status in RUNNING

    async def publish(self, frame: str) -> None:
        async with self._changed:
            self.frames.append(frame)
            self._changed.notify_all()
        self.grow(len(frame))

    async def end(self) -> None:
        """Wake every follower once the run is over (whatever its status) and its last frame is out."""
        async with self._changed:
            self.ended = True
            self._changed.notify_all()

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The stream's frames after sequence number ``after`` (-1: from the start), then the live ones until the
        run ends."""
        i = after + 1
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda at=i: at < len(self.frames) or self.ended)
                fresh = self.frames[i:]
            for frame in fresh:
                yield frame
            i += len(fresh)
            if not fresh and self.ended:
                return

    def input_list(self, limit: int, order: str, after: str | None) -> dict[str, Any]:
        """GET .../input_items: one page of this response's input items."""
        return item_page(self.inputs, limit, order, after, f"input item of response {self.id!r}")


def item_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None, what: str) -> dict[str, Any]:
    """One page of ``items`` (kept oldest first) as the API lists them: ``order`` "asc" or "desc", at most ``limit``,
    those after the item whose id is ``after`` (a 400 naming it if ``what`` has none)."""
    items = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, it in enumerate(items) if it["id"] == after), None)
        if at is None:
            raise APIError(400, f"no {what} has the id {after!r}", param="after")
        items = items[at + 1:]
    return listing(items[:limit], len(items) > limit)


def listing(page: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


def page_query(request: Request) -> tuple[int, str, str | None]:
    """A listing route's ``limit`` (1-100, default 20), ``order`` ("desc", the default, or "asc") and ``after``."""
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    return query_int(request, "limit", 20, 1, 100), order, request.query_params.get("after")


def json_size(obj: Any) -> int:
    """What ``obj`` weighs in the store's budget: the length of its JSON text."""
    return len(json.dumps(obj, ensure_ascii=False))


class ResponseStore:
    """At most ``capacity`` stored responses by id and about ``max_bytes`` of their text (None: no byte limit),
    the oldest finished ones dropped first."""

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.nbytes = 0  # the stored responses' text, as json_size and their frames count it
        # Over budget with every response running: nothing to drop until one is put or settles, so the events
        # that running responses publish meanwhile do not each scan the store.
        self._all_running = False
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, rid: str) -> StoredResponse:
        stored = self._by_id.get(rid)
        if stored is None:
            budget = "" if self.max_bytes is None else f" within {self.max_bytes} bytes"
            raise APIError(404, f"no response with id {rid!r} is stored on this server (never stored, deleted, or "
                                f"dropped as the store keeps the newest {self.capacity}{budget})", "not_found_error",
                           code="response_not_found")
        return stored

    def earlier(self, rid: str | None) -> list[dict[str, Any]]:
        """The conversation a request with ``previous_response_id`` = ``rid`` continues."""
        if not rid:
            return []
        if not self.enabled:
            raise APIError(400, "previous_response_id needs stored responses, and this server keeps none "
                                "(started with --responses-store-size 0)", param="previous_response_id")
        try:
            stored = self.get(rid)
        except APIError as e:
            e.param = "previous_response_id"
            raise
        if stored.conversation is None:
            what = "is still running" if stored.running else f"ended {stored.shape.status}"
            raise APIError(400, f"response {rid!r} {what}: only a completed or incomplete response can be continued",
                           param="previous_response_id")
        return stored.conversation

    def earlier_bytes(self, rid: str | None) -> int:
        """What the conversation that ``earlier(rid)`` returned weighs in the budget."""
        return self.get(rid).conversation_bytes if rid else 0

    def room(self, rid: str | None, background: bool) -> None:
        """Refuse before submitting what could not be stored: an id in use, or a background run when the store is
        full of running ones (a response whose client waits for it is stored whatever the count: it ends with
        its connection)."""
        if rid is not None and rid in self._by_id:
            raise APIError(409, f"a stored response already has the id {rid!r}", param="request_id")
        if background and len(self._by_id) >= self.capacity and all(s.running for s in self._by_id.values()):
            raise APIError(429, f"all {self.capacity} stored responses are still running", "rate_limit_error",
                           headers={"Retry-After": "1"})

    def put(self, stored: StoredResponse) -> None:
        """Keep ``stored`` (its request is already running, so this never refuses: room() did, before it was
        submitted; a store full of running responses grows past its limits until they end)."""
        if stored.id in self._by_id:
            self._drop(stored.id)
        stored.nbytes += json_size(stored.inputs)
        stored._owner = self
        self._by_id[stored.id] = stored
        self.nbytes += stored.nbytes
        self._all_running = False
        self._shrink(keep=stored.id)

    def restore(self, stored: StoredResponse) -> None:
        """Keep a finished response read back from a store file (store_file.py), its size as it was counted."""
        stored._owner = self
        self._by_id[stored.id] = stored
        self.nbytes += stored.nbytes
        self._shrink(keep=stored.id)

    def values(self) -> list[StoredResponse]:
        """The stored responses, oldest first."""
        return list(self._by_id.values())

    def grew(self, n: int, finished: bool = False) -> None:
        """A stored response keeps ``n`` more bytes (a frame; its conversation when it has ``finished``)."""
        self.nbytes += n
        self._all_running &= not finished
        if self.max_bytes is not None and self.nbytes > self.max_bytes and not self._all_running:
            self._shrink()

    def _shrink(self, keep: str | None = None) -> None:
        """Drop the oldest finished responses (but ``keep``) while the store is over its count or its bytes."""
        while len(self._by_id) > self.capacity or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            oldest = next((rid for rid, s in self._by_id.items() if not s.running and rid != keep), None)
            if oldest is None:
                self._all_running = keep is None
                return
            self._drop(oldest)

    def _drop(self, rid: str) -> None:
        stored = self._by_id.pop(rid)
        stored._owner = None
        self.nbytes -= stored.nbytes

    def delete(self, rid: str) -> None:
        stored = self.get(rid)
        if stored.stop is not None and stored.running:
            stored.stop()
        self._drop(rid)


def frame(event: dict[str, Any]) -> str:
    """One typed server-sent event (event: TYPE, then its JSON)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(400, f"{name} must be an integer, got {raw!r}", param=name) from None
    if not low <= value <= high:
        raise APIError(400, f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


def install(app: FastAPI, store: ResponseStore, api_key: str | None) -> None:
    """GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items."""

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, request: Request) -> Response:
        check_auth(request, api_key)
        stored = store.get(rid)
        stream = request.query_params.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise APIError(400, f"stream must be true or false, got {stream!r}", param="stream")
        if stream == "false":
            return JSONResponse(stored.shape.body())
        if not stored.background:
            raise APIError(400, f"response {rid!r} did not run in the background: only a background response's "
                                "events are kept to stream again", param="stream")
        after = query_int(request, "starting_after", -1, -1, 2**31)
        return StreamingResponse(stored.follow(after), media_type="text/event-stream")

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request) -> Response:
        check_auth(request, api_key)
        store.delete(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel(rid: str, request: Request) -> Response:
        check_auth(request, api_key)
        stored = store.get(rid)
        if not stored.background:
            raise APIError(400, f"response {rid!r} did not run in the background: only background responses can "
                                "be cancelled (a client stops its own by closing the connection)", param="response_id")
        if stored.running and stored.stop is not None:
            stored.stop()
            await asyncio.wait([stored.task])  # its jobs aborted, its status set
        return JSONResponse(stored.shape.body())

    @app.get("/v1/responses/{rid}/input_items")
    async def items(rid: str, request: Request) -> Response:
        check_auth(request, api_key)
        return JSONResponse(store.get(rid).input_list(*page_query(request)))

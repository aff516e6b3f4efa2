"""OpenAI's Conversations API (/v1/conversations): a conversation kept on the server as a list of items, which a
/v1/responses request names (``conversation``) to have those items read before its input and its input and output
appended once it finishes.

Why: clients built on the Responses API (agents, SDK helpers) keep long-lived state this way instead of chaining
``previous_response_id``; a conversation can also be edited (items added or deleted) between turns. The items are
the Responses API's input items (messages with text, function calls and their outputs), validated as the chat
they become before they are kept. Like stored responses, conversations live in memory, at most ``capacity`` of
them and about ``max_bytes`` of their items' JSON text, the least recently used dropped first (404 afterwards,
naming the limits); they outlive a restart only with ``--responses-store-file`` (store_file.py).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvpage.entrypoints.openai.http_input import check_auth
from kvpage.entrypoints.openai.protocol import APIError
from kvpage.entrypoints.openai.response_store import input_items, item_page, json_size, listing, page_query

MAX_ITEMS_PER_CALL = 20  # OpenAI's limit on the items of one create or add call
MESSAGE_ROLES = ("user", "assistant", "system", "developer")


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0  # the items' JSON text and the metadata's, as the store's budget counts them

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def item(self, item_id: str) -> dict[str, Any]:
        found = next((it for it in self.items if it["id"] == item_id), None)
        if found is None:
            raise APIError(404, f"no item {item_id!r} in conversation {self.id!r}", "not_found_error",
                           code="item_not_found")
        return found

    def page(self, limit: int, order: str, after: str | None) -> dict[str, Any]:
        """GET .../items: one page of the items, oldest first (asc) or newest first (desc)."""
        return item_page(self.items, limit, order, after, f"item of conversation {self.id!r}")


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's metadata rules: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise APIError(400, "metadata must be an object of at most 16 key-value pairs", param="metadata")
    for k, v in metadata.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise APIError(400, f"metadata[{k!r}]: keys are strings of at most 64 characters and values strings of "
                                "at most 512", param="metadata")
    return metadata


ToChat = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]  # the chat messages of items (responses.py)
Parse = Callable[[Request, type], Awaitable[Any]]  # the server's body reader: key, size and JSON limits, model


class ConversationBody(BaseModel):
    """A create, update or add-items body; its fields are checked by check_items and check_metadata."""

    items: Any = None
    metadata: Any = None


def check_items(items: Any, to_chat: ToChat, param: str = "items") -> list[dict[str, Any]]:
    """Items as a conversation keeps them (an id on each), after checking with ``to_chat`` that they make a chat
    (every item a message with text, a function call or a function call's output)."""
    if not isinstance(items, list) or not all(isinstance(it, dict) for it in items):
        raise APIError(400, f"{param} must be a list of items", param=param)
    if len(items) > MAX_ITEMS_PER_CALL:
        raise APIError(400, f"at most {MAX_ITEMS_PER_CALL} items can be added at once, got {len(items)}", param=param)
    for i, it in enumerate(items):
        if it.get("type", "message") == "message" and it.get("role") not in MESSAGE_ROLES:
            raise APIError(400, f"{param}[{i}]: a message's role is one of {', '.join(MESSAGE_ROLES)}, got "
                                f"{it.get('role')!r}", param=param)
    if items:
        try:
            to_chat(items)
        except APIError as e:
            raise APIError(400, e.message.replace("input[", f"{param}["), param=param) from None
    return input_items(items)


class ConversationStore:
    """At most ``capacity`` conversations and about ``max_bytes`` of their items (None: no byte limit), the least
    recently used dropped first; ``capacity`` 0 keeps none (every route then says so)."""

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.nbytes = 0
        self._by_id: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def create(self, items: list[dict[str, Any]], metadata: dict[str, str]) -> Conversation:
        if self.capacity == 0:
            raise APIError(400, "this server keeps no conversations (started with --responses-store-size 0)",
                           param="conversation")
        conv = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata)
        self._by_id[conv.id] = conv
        self._grow(conv, json_size(metadata))
        self.append(conv, items)
        return conv

    def restore(self, conv: Conversation) -> None:
        """Keep a conversation read back from a store file (store_file.py), as the most recently used."""
        if self.capacity == 0:
            return
        self._by_id[conv.id] = conv
        self.nbytes += conv.nbytes
        self._grow(conv, 0)  # this start's limits: the least recently used others dropped

    def values(self) -> list[Conversation]:
        """The conversations, least recently used first."""
        return list(self._by_id.values())

    def get(self, cid: Any, param: str = "conversation_id") -> Conversation:
        """The conversation ``cid`` names (its id, or an object carrying it as ``id``), now the most recent."""
        if isinstance(cid, dict):
            cid = cid.get("id")
        if not isinstance(cid, str):
            raise APIError(400, "conversation must be a conversation id or an object with its id", param=param)
        conv = self._by_id.get(cid)
        if conv is None and self.capacity == 0:
            raise APIError(404, f"no conversation with id {cid!r}: this server keeps none (started with "
                                "--responses-store-size 0)", "not_found_error", param=param,
                           code="conversation_not_found")
        if conv is None:
            budget = "" if self.max_bytes is None else f" within {self.max_bytes} bytes"
            raise APIError(404, f"no conversation with id {cid!r} is kept on this server (never created, deleted, or "
                                f"dropped as the server keeps the {self.capacity} most recently used{budget})",
                           "not_found_error", param=param, code="conversation_not_found")
        self._by_id.move_to_end(cid)
        return conv

    def append(self, conv: Conversation, items: list[dict[str, Any]]) -> None:
        """Add ``items`` at the end (a no-op for a conversation deleted or dropped meanwhile)."""
        if self._by_id.get(conv.id) is not conv:
            return
        conv.items.extend(items)
        self._grow(conv, json_size(items) if items else 0)

    def update(self, conv: Conversation, metadata: dict[str, str]) -> None:
        self._grow(conv, json_size(metadata) - json_size(conv.metadata))
        conv.metadata = metadata

    def remove_item(self, conv: Conversation, item_id: str) -> None:
        item = conv.item(item_id)
        conv.items.remove(item)
        self._grow(conv, -json_size([item]))

    def delete(self, cid: str) -> None:
        conv = self.get(cid)
        del self._by_id[conv.id]
        self.nbytes -= conv.nbytes

    def _grow(self, conv: Conversation, n: int) -> None:
        """Count ``n`` more bytes for ``conv``; then drop the least recently used others while over a limit."""
        conv.nbytes += n
        self.nbytes += n
        while len(self._by_id) > self.capacity or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            victim = next((cid for cid in self._by_id if cid != conv.id), None)
            if victim is None:
                return
            self.nbytes -= self._by_id.pop(victim).nbytes


def install(app: FastAPI, store: ConversationStore, api_key: str | None, parse: Parse, to_chat: ToChat) -> None:
    """The Conversations API's routes: create, retrieve, update, delete; list, add, retrieve and delete items."""

    @app.post("/v1/conversations")
    async def create(request: Request) -> Response:
        body = await parse(request, ConversationBody)
        conv = store.create(check_items(body.items or [], to_chat), check_metadata(body.metadata))
        return JSONResponse(conv.body())

    @app.get("/v1/conversations/{cid}")
    async def retrieve(cid: str, request: Request) -> Response:
        check_auth(request, api_key)
        return JSONResponse(store.get(cid).body())

    @app.post("/v1/conversations/{cid}")
    async def update(cid: str, request: Request) -> Response:
        body = await parse(request, ConversationBody)
        if "metadata" not in body.model_fields_set:
            raise APIError(400, "metadata is required", param="metadata")
        conv = store.get(cid)
        store.update(conv, check_metadata(body.metadata))
        return JSONResponse(conv.body())

    @app.delete("/v1/conversations/{cid}")
    async def delete(cid: str, request: Request) -> Response:
        check_auth(request, api_key)
        store.delete(cid)
        return JSONResponse({"id": cid, "object": "conversation.deleted", "deleted": True})

    @app.get("/v1/conversations/{cid}/items")
    async def list_items(cid: str, request: Request) -> Response:
        check_auth(request, api_key)
        return JSONResponse(store.get(cid).page(*page_query(request)))

    @app.post("/v1/conversations/{cid}/items")
    async def add_items(cid: str, request: Request) -> Response:
        body = await parse(request, ConversationBody)
        conv = store.get(cid)
        items = check_items(body.items, to_chat)
        store.append(conv, items)
        return JSONResponse(listing(items))

    @app.get("/v1/conversations/{cid}/items/{item_id}")
    async def get_item(cid: str, item_id: str, request: Request) -> Response:
        check_auth(request, api_key)
        return JSONResponse(store.get(cid).item(item_id))

    @app.delete("/v1/conversations/{cid}/items/{item_id}")
    async def delete_item(cid: str, item_id: str, request: Request) -> Response:
        check_auth(request, api_key)
        conv = store.get(cid)
        store.remove_item(conv, item_id)
        return JSONResponse(conv.body())

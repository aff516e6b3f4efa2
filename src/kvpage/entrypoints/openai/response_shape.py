"""One /v1/responses response as it builds up: its output items (a message with its output_text, function
calls), whole or from a stream of chat deltas (ToolReply's), its status through the run, its body as the API
returns it, and the stream's typed events (responses.py runs the request; response_store.py keeps it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from kvpage.entrypoints.openai.protocol import APIError
from kvpage.entrypoints.openai.response_store import RUNNING


def _hex(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape:
    """One response's output items, built whole or from a stream of chat deltas (ToolReply's), with the stream's
    typed events."""

    def __init__(self, req: Any, chat: Any, run: Any, model: str,
                 stored: bool = False, conversation: str | None = None) -> None:
        # the run's id only: a stored response outlives its run, whose prompt token ids it need not hold
        self.req, self.chat, self.id, self.model, self.stored = req, chat, run.id, model, stored
        self.conversation = conversation  # the Conversations API's conversation this turn joins
        self.created = time.time()
        self.items: list[dict[str, Any]] = []
        self.seq = 0
        self.text_item: dict[str, Any] | None = None  # the message being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # streamed call index -> its item
        self.pending: list[dict[str, Any]] = []  # streamed tokens' logprobs whose text has not come out yet
        self.status = "queued" if req.background else "in_progress"
        self.usage: dict[str, Any] | None = None
        self.reason: str | None = None  # the chat's finish reason
        self.error: dict[str, Any] | None = None

    def settle(self, reason: str | None, usage: dict[str, Any]) -> None:
        self.status = "incomplete" if reason == "length" else "completed"
        self.reason, self.usage = reason, usage

    def fail(self, e: BaseException) -> None:
        """A run that ended without its reply: cancelled (by the client, or its connection gone) or failed."""
        if self.status not in RUNNING:  # it had ended; what came after (a closed stream) changes nothing
            return
        if isinstance(e, APIError) and e.status != 499:
            self.status, self.error = "failed", {"code": str(e.code or e.status), "message": e.message}
        elif isinstance(e, APIError | asyncio.CancelledError | GeneratorExit):
            self.status = "cancelled"
        else:
            self.status, self.error = "failed", {"code": "server_error", "message": f"internal error: {e!r}"}

    def body(self) -> dict[str, Any]:
        plan, req = self.chat.tool_plan(), self.req
        return {"id": self.id, "object": "response", "created_at": int(self.created), "status": self.status,
                "background": bool(req.background), "error": self.error,
                "conversation": {"id": self.conversation} if self.conversation else None,
                "incomplete_details": {"reason": "max_output_tokens"} if self.reason == "length" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.model, "output": self.items, "parallel_tool_calls": plan.parallel,
                "previous_response_id": req.previous_response_id, "reasoning": None, "store": self.stored,
                "temperature": 1.0 if self.chat.temperature is None else self.chat.temperature,
                "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice if req.tool_choice is not None else plan.kind,
                "tools": req.tools or [], "top_p": 1.0 if self.chat.top_p is None else self.chat.top_p,
                "truncation": "disabled", "usage": self.usage, "user": self.chat.user, "metadata": req.metadata or {}}

    def whole(self, message: dict[str, Any], finish: str | None, logprobs: list | None = None) -> None:
        status = "incomplete" if finish == "length" else "completed"
        if message.get("content") or not message.get("tool_calls"):  # an empty reply is an empty message
            self.items.append({"type": "message", "id": _hex("msg"), "status": status, "role": "assistant",
                               "content": [{"type": "output_text", "text": message.get("content") or "",
                                            "annotations": [], "logprobs": logprobs or []}]})
        for call in message.get("tool_calls") or []:
            self.items.append({"type": "function_call", "id": _hex("fc"), "call_id": call["id"],
                               "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                               "status": "completed"})

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _close_text(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        part, at = item["content"][0], self.items.index(item)
        part["logprobs"] += self.pending  # tokens whose text had not come out yet (a cut multi-byte character)
        self.pending = []
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": at}
        return [self.event("response.output_text.done", **ids, content_index=0, text=part["text"],
                           logprobs=part["logprobs"]),
                self.event("response.content_part.done", **ids, content_index=0, part=part),
                self.event("response.output_item.done", output_index=at, item=item)]

    def _open_text(self) -> list[dict[str, Any]]:
        self.text_item = {"type": "message", "id": _hex("msg"), "status": "in_progress", "role": "assistant",
                          "content": []}
        self.items.append(self.text_item)
        at = len(self.items) - 1
        events = [self.event("response.output_item.added", output_index=at, item={**self.text_item, "content": []})]
        self.text_item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        events.append(self.event("response.content_part.added", item_id=self.text_item["id"], output_index=at,
                                 content_index=0, part=dict(self.text_item["content"][0])))
        return events

    def step(self, delta: dict[str, Any], logprobs: list | None = None) -> list[dict[str, Any]]:
        """Events for one chat delta: text (with its tokens' ``logprobs``, if asked for) to the message item, call
        pieces to their function_call items."""
        events = []
        self.pending += logprobs or []
        if delta.get("content"):
            if self.text_item is None:
                events += self._open_text()
            part, carried, self.pending = self.text_item["content"][0], self.pending, []
            part["text"] += delta["content"]
            part["logprobs"] += carried
            events.append(self.event("response.output_text.delta", item_id=self.text_item["id"],
                                     output_index=self.items.index(self.text_item), content_index=0,
                                     delta=delta["content"], logprobs=carried))
        for piece in delta.get("tool_calls") or []:
            events += self._close_text()
            item = self.calls.get(piece["index"])
            if item is None:
                item = {"type": "function_call", "id": _hex("fc"), "call_id": piece["id"],
                        "name": piece["function"]["name"], "arguments": "", "status": "in_progress"}
                self.calls[piece["index"]] = item
                self.items.append(item)
                events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=dict(item)))
            args = piece["function"].get("arguments") or ""
            if args:
                item["arguments"] += args
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.items.index(item), delta=args))
        return events

    def finish(self, reason: str | None) -> list[dict[str, Any]]:
        events = self._open_text() if not self.items else []  # an empty reply is an empty message
        events += self._close_text("incomplete" if reason == "length" else "completed")
        for item in self.calls.values():
            item["status"] = "completed"
            at = self.items.index(item)
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                     arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=at, item=item))
        return events

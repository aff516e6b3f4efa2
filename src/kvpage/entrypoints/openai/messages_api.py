"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) over the chat path, as vLLM's server
offers it, so that clients written for that API (its SDKs, coding agents) can use a kvpage server.

A request's ``system`` and ``messages`` (text blocks, the assistant's ``tool_use`` blocks and the user's
``tool_result`` blocks) become a chat conversation; ``tools`` ({name, description, input_schema}) and
``tool_choice`` (auto, any, tool, none) the chat's tools and tool choice ("any" is chat's "required");
``stop_sequences``, ``temperature``, ``top_p`` and ``top_k`` (and vLLM's extras: seed, penalties, ...) its
sampling. The reply comes back as a message of content blocks (text, tool_use with its input as an object),
``stop_reason`` end_turn / max_tokens / stop_sequence / tool_use, whole or as the API's stream events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop). Errors take that API's shape
({"type": "error", "error": {"type", "message"}}). Refused by name: images and documents, extended thinking,
server tools (a tool whose ``type`` is other than "custom").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvpage.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from kvpage.entrypoints.openai.response_store import frame
from kvpage.entrypoints.openai.responses import text_of
from kvpage.entrypoints.openai.serving import ChatRun, RequestRunner

# HTTP status -> the error type this API names it with
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# the chat route's extras a Messages request may carry too (vLLM's sampling fields), handed over as they are
_EXTRAS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens",
           "priority", "cache_salt", "request_id")


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def chat(self) -> ChatCompletionRequest:
        """The chat request this asks for (400s name the field at fault)."""
        if self.thinking and self.thinking.get("type") not in (None, "disabled"):
            raise APIError(400, "extended thinking is not supported: this model does not reason apart",
                           param="thinking")
        turns = [{"role": "system", "content": text_of(self.system, "system", "system", ("text",))}] \
            if self.system else []
        for i, message in enumerate(self.messages):
            turns.extend(_turns(message, f"messages[{i}]"))
        body: dict[str, Any] = {"model": self.model, "messages": turns, "max_tokens": self.max_tokens,
                                "stream": self.stream}
        for ours, theirs in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                             ("stop", self.stop_sequences)):
            if theirs is not None:
                body[ours] = theirs
        body.update({k: v for k, v in (self.model_extra or {}).items() if k in _EXTRAS})
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            kind = self.tool_choice.get("type")
            choices = {"auto": "auto", "any": "required", "none": "none"}
            if kind == "tool":
                body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.get("name")}}
            elif kind in choices:
                body["tool_choice"] = choices[kind]
            else:
                raise APIError(400, f"tool_choice type must be auto, any, tool or none, got {kind!r}",
                               param="tool_choice")
            if self.tool_choice.get("disable_parallel_tool_use"):
                body["parallel_tool_calls"] = False
        try:
            return ChatCompletionRequest(**body)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None


def _turns(message: Any, where: str) -> list[dict[str, Any]]:
    """One message as chat messages: an assistant's text and tool_use blocks as one turn with tool calls, a user's
    tool_result blocks as tool messages (before the rest of its text)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise APIError(400, f"{where}: a message needs the role user or assistant", param="messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be text or a list of content blocks", param="messages")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
        elif kind == "tool_result" and role == "user":
            body = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": text_of(body, f"{at}.content", "messages", ("text",)) if body else ""})
        else:
            raise APIError(400, f"{at}: content blocks of type {kind!r} are not supported in a {role} message (text, "
                                "tool_use from the assistant and tool_result from the user are)", param="messages")
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        return [{**turn, "tool_calls": calls} if calls else turn]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or not tool.get("name"):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(400, f"tools[{index}]: only client tools ({{name, description, input_schema}}) are supported, "
                            f"got {kind!r}", param="tools")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def error_body(e: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.printable_message}}


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's content and tool calls as this API's content blocks."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = {}
        blocks.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                       "input": args})
    return blocks


def _stop_reason(reason: str | None, stop_seq: str | None, called: bool) -> str | None:
    """This API's stop reason: a forced call ends "tool_use" too (chat answers it "stop")."""
    if stop_seq:
        return "stop_sequence"
    if called and reason in ("stop", "tool_calls"):
        return "tool_use"
    return _STOP_REASONS.get(reason or "", reason)


def _tool_id(chat_id: str) -> str:
    return "toolu_" + chat_id.rsplit("-", 1)[-1]


def _event(kind: str, **fields: Any) -> str:
    return frame({"type": kind, **fields})


class _Blocks:
    """A streamed message's content blocks: which one is open, and the events that open, fill and close them
    (text deltas go to an open text block, each new call gets a tool_use block of its own)."""

    def __init__(self) -> None:
        self.index, self.open, self.called = -1, None, False

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.index, self.open = self.index + 1, kind
        return [*events, _event("content_block_start", index=self.index, content_block=block)]

    def step(self, delta: dict[str, Any]) -> list[str]:
        """The events of one chat delta (ToolReply's)."""
        events = []
        if delta.get("content"):
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            self.called = True
            if "id" in call:  # a new call
                events += self._start("tool_use", {"type": "tool_use", "id": _tool_id(call["id"]),
                                                   "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                events.append(_event("content_block_delta", index=self.index, delta={
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return events


def install(app: FastAPI, parse: Callable[[Request, type], Awaitable[Any]],
            start_chat: Callable[[ChatCompletionRequest, str], Awaitable[ChatRun]],
            prompt_ids: Callable[[ChatCompletionRequest], Awaitable[list[int]]],
            runner: RequestRunner, model_name: str) -> None:
    """POST /v1/messages and /v1/messages/count_tokens."""

    def anthropic_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)
        return wrapped

    @anthropic_errors
    async def count_tokens(request: Request) -> Response:
        req: MessagesRequest = await parse(request, _CountRequest)
        return JSONResponse({"input_tokens": len(await prompt_ids(req.chat()))})

    @anthropic_errors
    async def messages(request: Request) -> Response:
        req: MessagesRequest = await parse(request, MessagesRequest)
        run = await start_chat(req.chat(), "msg")
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        n_in = len(run.jobs[0].prompt_ids)
        head = {"id": msg_id, "type": "message", "role": "assistant", "model": req.model or model_name}
        if not req.stream:
            out = (await runner.collect(request, run.jobs, run.outputs))[run.jobs[0].request_id]
            c = out.outputs[0]
            message, reason = run.replies[0].message(c.text, c.finish_reason)
            stop_seq = c.stop_reason if isinstance(c.stop_reason, str) else None
            blocks = _blocks(message)
            called = any(b["type"] == "tool_use" for b in blocks)
            return JSONResponse({**head, "content": blocks, "stop_reason": _stop_reason(reason, stop_seq, called),
                                 "stop_sequence": stop_seq,
                                 "usage": {"input_tokens": n_in, "output_tokens": len(c.token_ids),
                                           "cache_read_input_tokens": out.num_cached_tokens}})

        async def events() -> AsyncIterator[str]:
            yield _event("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                                   "usage": {"input_tokens": n_in, "output_tokens": 0}})
            blocks, n_out, reason, stop_seq = _Blocks(), 0, None, None
            try:
                async with aclosing(runner.changes(request, run.jobs, run.outputs)) as it:
                    async for _, _, c in it:
                        n_out += len(c.token_ids)
                        delta, finished = run.replies[0].delta(c.text, c.finish_reason)
                        reason = finished or reason
                        if isinstance(c.stop_reason, str):
                            stop_seq = c.stop_reason
                        for event in blocks.step(delta):
                            yield event
            except APIError as e:
                if e.status != 499:
                    yield _event("error", error=error_body(e)["error"])
                return
            for event in blocks.stop():
                yield event
            yield _event("message_delta", delta={"stop_reason": _stop_reason(reason, stop_seq, blocks.called),
                                                 "stop_sequence": stop_seq}, usage={"output_tokens": n_out})
            yield _event("message_stop")

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_api_route("/v1/messages", messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])


class _CountRequest(MessagesRequest):
    """count_tokens takes a message request without max_tokens."""

    max_tokens: int = 1

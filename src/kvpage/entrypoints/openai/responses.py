"""OpenAI's Responses API (POST /v1/responses) over the chat path: a request's ``instructions`` and ``input`` items
become a chat conversation (text messages, earlier function calls and their outputs), its fields the chat's
sampling, output form (``text.format``) and tools, and the chat's reply comes back as output items (a message
with its output_text, function calls), whole or as the API's typed stream events.

Not kept: responses are not stored, so ``previous_response_id`` and ``background`` are refused by name, as are
reasoning settings, ``include``, ``truncation: "auto"``, prompt templates and input other than text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvpage.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from kvpage.entrypoints.openai.serving import ChatRun, RequestRunner

# sampling fields a Responses request may carry (OpenAI's and vLLM's extras), handed to the chat as they are
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "stop", "user", "priority", "cache_salt", "request_id")


# fields this server refuses unless they carry their neutral value; those that need stored responses
_NOT_KEPT = {"previous_response_id": (None, ""), "background": (None, False), "conversation": (None,),
             "include": (None, []), "prompt": (None,), "top_logprobs": (None, 0)}
_NEED_STORE = ("previous_response_id", "background", "conversation")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None

    def check(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in _NOT_KEPT.items():
            if extra.get(name) not in neutral:
                why = " (responses are not stored)" if name in _NEED_STORE else ""
                raise APIError(400, f"{name} is not supported by this server{why}", param=name,
                               code="unsupported_parameter")
        reasoning = extra.get("reasoning")
        if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
            raise APIError(400, "reasoning settings are not supported: this model does not reason apart",
                           param="reasoning", code="unsupported_parameter")
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not supported: send 'disabled' (an input that does not fit is "
                                "a 400)", param="truncation", code="unsupported_parameter")

    def chat(self) -> ChatCompletionRequest:
        """The chat request this asks for."""
        self.check()
        body: dict[str, Any] = {"messages": messages(self.instructions, self.input), "stream": self.stream,
                                "max_tokens": self.max_output_tokens, "model": self.model}
        body.update({k: v for k, v in (self.model_extra or {}).items() if k in _SAMPLING})
        if self.tools is not None:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
                choice = {"type": "function", "function": {"name": choice.get("name")}}
            body["tool_choice"] = choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise APIError(400, "text.format must be an object", param="text")
            if fmt.get("type") == "json_schema":  # flat in the Responses API, nested in chat's response_format
                fmt = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
            body["response_format"] = fmt
        try:
            return ChatCompletionRequest(**body)
        except ValueError as e:
            raise APIError(400, f"input: {e}", param="input") from None


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(400, f"tools[{index}]: only function tools are supported, got {kind!r}", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be text or a list of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise APIError(400, f"{where}: only text parts are supported, got {kind!r}", param="input")
        parts.append(part["text"])
    return "".join(parts)


def messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from the instructions (a system message first) and the input items."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input is empty", param="input")
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if "role" not in item:
                raise APIError(400, f"{where}: a message needs a role", param="input")
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call "
                                "and function_call_output are)", param="input")
    return out


def _hex(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape:
    """One response's output items, built whole or from a stream of chat deltas (ToolReply's), with the stream's
    typed events."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, run: ChatRun, model: str) -> None:
        self.req, self.chat, self.run, self.model = req, chat, run, model
        self.created = time.time()
        self.items: list[dict[str, Any]] = []
        self.seq = 0
        self.text_item: dict[str, Any] | None = None  # the message being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # streamed call index -> its item

    def body(self, status: str, usage: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        plan = self.chat.tool_plan()
        return {"id": self.run.id, "object": "response", "created_at": int(self.created), "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
                "model": self.model, "output": self.items, "parallel_tool_calls": plan.parallel,
                "previous_response_id": None, "reasoning": None, "store": False,
                "temperature": 1.0 if self.chat.temperature is None else self.chat.temperature,
                "text": self.req.text or {"format": {"type": "text"}},
                "tool_choice": self.req.tool_choice if self.req.tool_choice is not None else plan.kind,
                "tools": self.req.tools or [], "top_p": 1.0 if self.chat.top_p is None else self.chat.top_p,
                "truncation": "disabled", "usage": usage, "user": self.chat.user, "metadata": self.req.metadata or {}}

    def whole(self, message: dict[str, Any], finish: str | None) -> None:
        status = "incomplete" if finish == "length" else "completed"
        if message.get("content") or not message.get("tool_calls"):  # an empty reply is an empty message
            self.items.append({"type": "message", "id": _hex("msg"), "status": status, "role": "assistant",
                               "content": [{"type": "output_text", "text": message.get("content") or "",
                                            "annotations": [], "logprobs": []}]})
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
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": at}
        return [self.event("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[]),
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

    def step(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chat delta: text to the message item, call pieces to their function_call items."""
        events = []
        if delta.get("content"):
            if self.text_item is None:
                events += self._open_text()
            self.text_item["content"][0]["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=self.text_item["id"],
                                     output_index=self.items.index(self.text_item), content_index=0,
                                     delta=delta["content"], logprobs=[]))
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


def _usage(run: ChatRun, n_out: int, cached: int) -> dict[str, Any]:
    n_in = len(run.jobs[0].prompt_ids)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def install(app: FastAPI, parse: Callable[[Request, type], Awaitable[Any]],
            start_chat: Callable[[ChatCompletionRequest, str], Awaitable[ChatRun]],
            runner: RequestRunner, model_name: str) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req: ResponsesRequest = await parse(request, ResponsesRequest)
        chat = req.chat()
        run = await start_chat(chat, "resp")
        shape = ResponseShape(req, chat, run, model_name)
        if not req.stream:
            out = (await runner.collect(request, run.jobs, run.outputs))[run.jobs[0].request_id]
            c = out.outputs[0]
            message, _ = run.replies[0].message(c.text, c.finish_reason)
            shape.whole(message, c.finish_reason)
            status = "incomplete" if c.finish_reason == "length" else "completed"
            return JSONResponse(shape.body(status, _usage(run, len(c.token_ids), out.num_cached_tokens),
                                           c.finish_reason))

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield shape.event("response.created", response=shape.body("in_progress"))
            yield shape.event("response.in_progress", response=shape.body("in_progress"))
            n_out, cached, finish = 0, 0, None
            async with aclosing(runner.changes(request, run.jobs, run.outputs)) as it:
                async for _, out, c in it:
                    n_out, cached = n_out + len(c.token_ids), out.num_cached_tokens
                    delta, _ = run.replies[0].delta(c.text, c.finish_reason)
                    finish = c.finish_reason or finish
                    for event in shape.step(delta):
                        yield event
            for event in shape.finish(finish):
                yield event
            status = "incomplete" if finish == "length" else "completed"
            yield shape.event(f"response.{status}", response=shape.body(status, _usage(run, n_out, cached), finish))

        return StreamingResponse(_sse(events(), shape), media_type="text/event-stream")


async def _sse(events: AsyncIterator[dict[str, Any]], shape: ResponseShape) -> AsyncIterator[str]:
    """Typed server-sent events (event: TYPE, then its JSON); a failure mid-stream ends it with an error event."""
    try:
        async with aclosing(events) as it:
            async for obj in it:
                yield f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"
    except APIError as e:
        if e.status != 499:
            err = shape.event("error", code=str(e.code or e.status), message=e.message, param=e.param)
            yield f"event: error\ndata: {json.dumps(err, ensure_ascii=False)}\n\n"
    except Exception as e:  # a bug while rendering: this stream ends with an error, the server goes on
        err = shape.event("error", code="server_error", message=f"internal error: {type(e).__name__}", param=None)
        yield f"event: error\ndata: {json.dumps(err, ensure_ascii=False)}\n\n"

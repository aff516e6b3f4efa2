"""OpenAI's Responses API (POST /v1/responses) over the chat path: a request's ``instructions`` and ``input`` items
become a chat conversation (text messages, earlier function calls and their outputs), its fields the chat's
sampling, output form (``text.format``) and tools, and the chat's reply comes back as output items (a message
with its output_text and, if asked for, its tokens' logprobs; function calls), whole or as the API's typed stream
events (response_shape.py).

Responses are stored (response_store.py) unless the request says ``store: false`` or the server keeps none: a
later request continues one with ``previous_response_id``, and ``background: true`` runs one apart from the
client's connection; ``conversation`` names a conversation of the Conversations API (conversations.py), whose items
come before the input and which gets the input and the reply once the response finishes. Refused by name:
reasoning settings, ``include`` other than the output text's logprobs (and those beside tool calls),
``truncation: "auto"``, prompt templates and input other than text.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvpage.entrypoints.openai.conversations import ConversationStore
from kvpage.entrypoints.openai.conversations import install as install_conversations
from kvpage.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from kvpage.entrypoints.openai.response_shape import ResponseShape
from kvpage.entrypoints.openai.response_store import ResponseStore, StoredResponse, frame, input_items
from kvpage.entrypoints.openai.response_store import install as install_retrieval
from kvpage.entrypoints.openai.serving import ChatRun, RequestRunner, chat_logprobs, stop
from kvpage.entrypoints.openai.store_file import restore
from kvpage.outputs import CompletionOutput
from kvpage.sampling_params import MAX_LOGPROBS

# sampling fields a Responses request may carry (OpenAI's and vLLM's extras), handed to the chat as they are
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "stop", "user", "priority", "cache_salt", "request_id", "ignore_eos", "min_tokens")


# fields this server refuses unless they carry their neutral value
_NOT_KEPT = {"prompt": (None,)}
LOGPROBS = "message.output_text.logprobs"  # the one ``include`` this server answers


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
    background: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["disabled", "auto"] | None = None
    conversation: str | dict[str, Any] | None = None

    def check(self, storing: bool = True) -> None:
        """Refuse what this server cannot honour (``storing``: whether this response will be stored)."""
        extra = self.model_extra or {}
        for name, neutral in _NOT_KEPT.items():
            if extra.get(name) not in neutral:
                raise APIError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.conversation is not None and self.previous_response_id:
            raise APIError(400, "conversation and previous_response_id cannot both be given: a response continues "
                                "one or the other", param="conversation")
        for extra_item in self.include or []:
            if extra_item != LOGPROBS:
                raise APIError(400, f"include {extra_item!r} is not supported (only {LOGPROBS!r}: this server has no "
                                    "built-in tools, images or reasoning)", param="include",
                               code="unsupported_parameter")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")
        if self.background and (not storing or self.store is False):
            why = "the request says store false" if self.store is False else \
                "this server keeps none (started with --responses-store-size 0)"
            raise APIError(400, f"a background response must be stored, and {why}", param="background")
        reasoning = extra.get("reasoning")
        if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
            raise APIError(400, "reasoning settings are not supported: this model does not reason apart",
                           param="reasoning", code="unsupported_parameter")
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not supported: send 'disabled' (an input that does not fit is "
                                "a 400)", param="truncation", code="unsupported_parameter")

    def logprobs(self) -> bool:
        """Whether the output text's logprobs are asked for (include, or top_logprobs above 0)."""
        return LOGPROBS in (self.include or []) or bool(self.top_logprobs)

    def chat(self, conversation: list[dict[str, Any]] | None = None, storing: bool = True) -> ChatCompletionRequest:
        """The chat request this asks for: the instructions, then ``conversation`` (earlier turns and this input;
        by default this input alone)."""
        self.check(storing)
        turns = messages(None, self.input) if conversation is None else conversation
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {"messages": system + turns, "stream": self.stream or bool(self.background),
                                "max_tokens": self.max_output_tokens, "model": self.model}
        body.update({k: v for k, v in (self.model_extra or {}).items() if k in _SAMPLING})
        if self.logprobs():
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
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


TEXT_PARTS = ("input_text", "output_text", "text")  # the part types whose text an input item's content joins


def text_of(content: Any, where: str, param: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """Text, or a list of text parts (of ``kinds``) joined; anything else is a 400 naming ``where`` (``param``:
    the request field it sits in). The Messages API's text blocks are read with it too."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be text or a list of text parts", param=param)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{j}]: only text parts are supported here, got {kind!r}", param=param)
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
            out.append({"role": item["role"], "content": text_of(item.get("content"), f"{where}.content", "input")})
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
                        "content": text_of(output, f"{where}.output", "input")})
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call "
                                "and function_call_output are)", param="input")
    return out


def _logprobs(c: CompletionOutput, req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The output text's logprobs as this API gives them (chat's entries: token, logprob, bytes, top_logprobs)."""
    if not req.logprobs():
        return None
    lps = chat_logprobs(c, req.top_logprobs or 0)
    return lps["content"] if lps else []


def _usage(run: ChatRun, n_out: int, cached: int) -> dict[str, Any]:
    n_in = len(run.jobs[0].prompt_ids)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def install(app: FastAPI, parse: Callable[[Request, type], Awaitable[Any]],
            start_chat: Callable[[ChatCompletionRequest, str], Awaitable[ChatRun]],
            runner: RequestRunner, config: Any) -> tuple[ResponseStore, ConversationStore]:
    """POST /v1/responses, the stored responses' routes and the Conversations API; the two stores, for the caller
    to look into."""
    store = ResponseStore(config.responses_store_size, config.responses_store_memory)
    install_retrieval(app, store, config.api_key)
    conversations = ConversationStore(config.responses_store_size, config.responses_store_memory)
    install_conversations(app, conversations, config.api_key, parse, functools.partial(messages, None))
    if config.responses_saved is not None:  # what --responses-store-file held when the server started
        restore(config.responses_saved, store, conversations)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req: ResponsesRequest = await parse(request, ResponsesRequest)
        storing = store.enabled and req.store is not False
        req.check(storing)
        conv = None if req.conversation is None else conversations.get(req.conversation, param="conversation")
        before = store.earlier(req.previous_response_id) if conv is None else \
            messages(None, conv.items) if conv.items else []
        turn, inputs = messages(None, req.input), input_items(req.input)
        chat = req.chat(before + turn, storing)
        if req.logprobs() and chat.tool_plan().kind != "none":
            raise APIError(400, "the output text's logprobs are not given beside tool calls: ask for them with no "
                                "tools or tool_choice 'none'", param="include")
        if storing:
            store.room(f"resp-{chat.request_id}" if chat.request_id else None, bool(req.background))
        run = await start_chat(chat, "resp")
        shape = ResponseShape(req, chat, run, config.model_name, storing, conv.id if conv is not None else None)
        record = None
        if storing:
            # the earlier turns' size as counted when they were kept (a conversation's: its items), not re-measured
            earlier = store.earlier_bytes(req.previous_response_id) if conv is None else conv.nbytes
            record = StoredResponse(run.id, shape, before, inputs, bool(req.background), before_bytes=earlier)
            store.put(record)

        def settled(reason: str | None, n_out: int, cached: int) -> None:
            shape.settle(reason, _usage(run, n_out, cached))
            if record is not None:
                record.settle(turn + messages(None, shape.items))
            if conv is not None:  # this turn joins the conversation (a no-op if it was deleted meanwhile)
                conversations.append(conv, inputs + shape.items)

        async def events(client: Request | None) -> AsyncIterator[dict[str, Any]]:
            """The typed events of the run (``client``: the connection whose loss aborts it; None: none)."""
            try:
                shape.status = "in_progress"
                yield shape.event("response.created", response=shape.body())
                yield shape.event("response.in_progress", response=shape.body())
                n_out, cached, finish = 0, 0, None
                async with aclosing(runner.changes(client, run.jobs, run.outputs)) as it:
                    async for _, out, c in it:
                        n_out, cached = n_out + len(c.token_ids), out.num_cached_tokens
                        delta, _ = run.replies[0].delta(c.text, c.finish_reason)
                        finish = c.finish_reason or finish
                        for event in shape.step(delta, _logprobs(c, req)):
                            yield event
                for event in shape.finish(finish):
                    yield event
                settled(finish, n_out, cached)
                yield shape.event(f"response.{shape.status}", response=shape.body())
            except BaseException as e:
                shape.fail(e)
                raise

        if req.background:
            record.stop = functools.partial(stop, run.outputs)
            record.task = asyncio.create_task(_background(record, shape, events(None)))
            if not req.stream:
                return JSONResponse(shape.body())
            return StreamingResponse(record.follow(-1), media_type="text/event-stream")
        if req.stream:
            return StreamingResponse(_sse(events(request), shape), media_type="text/event-stream")
        try:
            out = (await runner.collect(request, run.jobs, run.outputs))[run.jobs[0].request_id]
        except BaseException as e:
            shape.fail(e)
            raise
        c = out.outputs[0]
        message, _ = run.replies[0].message(c.text, c.finish_reason)
        shape.whole(message, c.finish_reason, _logprobs(c, req))
        settled(c.finish_reason, len(c.token_ids), out.num_cached_tokens)
        return JSONResponse(shape.body())

    return store, conversations


async def _background(record: StoredResponse, shape: ResponseShape, events: AsyncIterator[dict[str, Any]]) -> None:
    """Run a background response to its end, keeping its stream's events for whoever follows it; a cancel
    (POST .../cancel, DELETE: record.stop) ends it as a disconnect would, its engine request aborted."""
    try:
        async with aclosing(events) as it:
            async for event in it:
                await record.publish(frame(event))
    except Exception as e:
        shape.fail(e)
        if shape.status == "failed":  # a cancel (stop(): a 499) ends the stream without an event
            error = shape.event("error", code=shape.error["code"], message=shape.error["message"], param=None)
            await record.publish(frame(error))
            await record.publish(frame(shape.event("response.failed", response=shape.body())))
    finally:
        shape.fail(asyncio.CancelledError())  # a no-op unless it ended without settling (the loop cancelled it)
        await record.end()


async def _sse(events: AsyncIterator[dict[str, Any]], shape: ResponseShape) -> AsyncIterator[str]:
    """Typed server-sent events; a failure mid-stream ends it with an error event."""
    try:
        async with aclosing(events) as it:
            async for obj in it:
                yield frame(obj)
    except APIError as e:
        if e.status != 499:
            yield frame(shape.event("error", code=str(e.code or e.status), message=e.message, param=e.param))
    except Exception as e:  # a bug while rendering: this stream ends with an error, the server goes on
        yield frame(shape.event("error", code="server_error", message=f"internal error: {type(e).__name__}",
                                param=None))

"""One HTTP request's life on the engine: submit its jobs, follow their outputs, and turn them into JSON bodies
or server-sent events, with every failure (refusal, engine error, shutdown, disconnect) mapped to an OpenAI
error. A stream always ends with ``data: [DONE]``, after an error event if something failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvpage.entrypoints.openai.engine_client import AsyncEngine
from kvpage.entrypoints.openai.metrics import ServerMetrics
from kvpage.entrypoints.openai.protocol import APIError, CompletionRequest
from kvpage.errors import (
    EngineDeadError,
    PromptTooLongError,
    QueueFullError,
    RequestIdInUseError,
    RequestRejected,
    ShuttingDownError,
)
from kvpage.outputs import CompletionOutput, RequestOutput
from kvpage.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


@dataclass
class Job:
    """One engine request of an HTTP request: prompt index, its token ids, and its engine request id."""

    index: int
    request_id: str
    prompt_ids: list[int]


@dataclass
class ChatRun:
    """A submitted chat: the response's id, its one job, the queue its outputs arrive in, and each choice's
    ToolReply (which turns the choice's text into a message)."""

    id: str
    jobs: list[Job]
    outputs: asyncio.Queue
    replies: list[Any]


def request_ids(prefix: str, req: Any) -> tuple[str, str]:
    """(the response's id, its jobs' prefix): the client's request_id names the response, while the engine's
    ids stay unique however clients reuse theirs."""
    rid = uuid.uuid4().hex
    return f"{prefix}-{req.request_id or rid}", f"{prefix}-{rid}"


def stream_usage(req: Any) -> tuple[bool, bool]:
    """(usage in a final chunk, usage in every chunk)."""
    so = req.stream_options
    return bool(so and so.include_usage), bool(so and so.continuous_usage_stats)


def api_error(e: BaseException) -> APIError:
    """The one map from the engine's errors (kvpage.errors) to HTTP: a refused request is the client's 4xx
    (400 with code context_length_exceeded for a prompt that fills the context, as OpenAI and vLLM answer it,
    409 for an id in use, 429 with Retry-After for a full queue),
    an engine that cannot serve is 503, anything else is the server's 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, RequestIdInUseError):
        return APIError(409, str(e), param=e.param)
    if isinstance(e, RequestRejected):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, ShuttingDownError | EngineDeadError):
        return APIError(503, str(e), "server_error")
    if isinstance(e, ValueError):  # a setting SamplingParams refused
        return APIError(400, str(e))
    return APIError(500, f"{type(e).__name__}: {e}", "server_error")


class RequestRunner:
    """Submits jobs and follows their outputs for the route handlers."""

    def __init__(self, client: AsyncEngine, metrics: ServerMetrics) -> None:
        self.client = client
        self.metrics = metrics

    async def start(self, jobs: list[Job], params: list[SamplingParams], cache_salt: str | None,
                    outputs: asyncio.Queue, priority: int = 0, form_param: str = "structured_outputs") -> None:
        """Submit every job; on any refusal abort those already accepted and raise the matching APIError
        (``form_param``: the field an output form that does not compile came from)."""
        forms = {p.structured_outputs.key: p.structured_outputs for p in params
                 if getattr(p, "structured_outputs", None) is not None}
        for form in forms.values():  # compiled here, off the engine's thread (which then finds them compiled)
            try:
                await asyncio.to_thread(self.client.engine.grammars.compile, form)
            except ValueError as e:
                raise APIError(400, str(e), param=form_param) from None
        accepted: list[str] = []
        try:
            for job, p in zip(jobs, params, strict=True):
                await self.client.submit(job.request_id, job.prompt_ids, p, outputs, cache_salt, priority)
                accepted.append(job.request_id)
        except BaseException as e:
            for rid in accepted:
                self.client.abort(rid)
            if isinstance(e, Exception):
                raise api_error(e) from None
            raise
        for job in jobs:
            self.metrics.add_prompt_tokens(len(job.prompt_ids))

    async def outputs(self, request: Request | None, jobs: list[Job],
                      queue: asyncio.Queue) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """(job, output) until every job finished (``request``: the connection to watch; None for a run no
        connection owns). A client disconnect, or the consumer stopping early, aborts
        the unfinished jobs at once (the engine frees their blocks at its next iteration). A job that failed in
        the engine raises its APIError."""
        by_id = {j.request_id: j for j in jobs}
        open_ids = set(by_id)
        # The disconnect watcher posts a marker into the same queue, so each output costs one plain await on
        # the queue (a task and an asyncio.wait over two futures per streamed token cost the event loop more
        # than rendering the token did).
        gone = None if request is None else asyncio.ensure_future(_until_disconnect(request))
        if gone is not None:
            gone.add_done_callback(_post_disconnect(queue))
        try:
            while open_ids:
                item = await queue.get()
                if item is _DISCONNECTED:
                    raise APIError(499, "client disconnected")
                if isinstance(item, BaseException):
                    open_ids.clear()  # the engine client already dropped every request of this queue
                    raise api_error(item)
                if item.request_id not in open_ids:
                    continue
                if item.finished:
                    open_ids.discard(item.request_id)
                if item.error:
                    raise APIError(500, f"the request failed in the engine: {item.error}", "server_error")
                yield by_id[item.request_id], item
        finally:
            if gone is not None:
                gone.cancel()
            for rid in open_ids:
                self.client.abort(rid)

    async def collect(self, request: Request, jobs: list[Job], queue: asyncio.Queue) -> dict[str, RequestOutput]:
        """Final outputs of every job (aborted, with a 499, if the client disconnects first)."""
        final: dict[str, RequestOutput] = {}
        async with aclosing(self.outputs(request, jobs, queue)) as it:
            async for job, out in it:
                if out.finished:
                    final[job.request_id] = out
        return final

    async def changes(self, request: Request | None, jobs: list[Job],
                      queue: asyncio.Queue) -> AsyncIterator[tuple[Job, RequestOutput, CompletionOutput]]:
        """Each completion that has something new (text, tokens or its finish) in a delta output."""
        async with aclosing(self.outputs(request, jobs, queue)) as it:
            async for job, out in it:
                for c in out.outputs:
                    if c.text or c.token_ids or c.finish_reason is not None:
                        yield job, out, c


_DISCONNECTED = object()  # the marker _until_disconnect's end puts into a request's output queue


def stop(queue: asyncio.Queue) -> None:
    """End a run that no connection owns as a disconnect would: its outputs() raises a 499 and aborts its jobs
    (at once if it is waiting, or as soon as it starts reading)."""
    queue.put_nowait(_DISCONNECTED)


def _post_disconnect(queue: asyncio.Queue) -> Callable[[asyncio.Future], None]:
    def done(watcher: asyncio.Future) -> None:
        if watcher.cancelled():  # the stream ended first
            return
        watcher.exception()  # retrieved: a watcher that failed counts as a disconnect too
        queue.put_nowait(_DISCONNECTED)
    return done


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events ending in [DONE]; any failure mid-stream becomes an error event first (a client that
    disconnected reads nothing, and its jobs are already aborted)."""
    async def body() -> AsyncIterator[str]:
        try:
            async with aclosing(events) as it:
                async for obj in it:
                    yield sse(obj)
        except APIError as e:
            if e.status == 499:
                return
            yield sse(e.body())
        except Exception as e:  # a bug while rendering: this stream ends with an error, the server goes on
            logger.exception("stream failed")
            yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error").body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def usage(jobs: list[Job], completion_tokens: int, cached: int) -> dict[str, Any]:
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _lp(value: float) -> float:
    """A logprob JSON can carry (-inf, from a token of zero probability, becomes -9999 as in vLLM)."""
    return value if value > -9999.0 else -9999.0


def best_samples(samples: list[CompletionOutput], req: CompletionRequest) -> list[CompletionOutput]:
    """best_of > n: the n samples with the highest sum of their tokens' logprobs, as choices 0..n-1 in that
    order (OpenAI's legacy best_of); the logprobs asked for only to rank them stay out of the response."""
    ranked = sorted(samples, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[: req.n]
    keep = req.logprobs is not None
    return [replace(c, index=i, logprobs=c.logprobs if keep else None,
                    cumulative_logprob=c.cumulative_logprob if keep else None) for i, c in enumerate(ranked)]


def completion_logprobs(c: CompletionOutput, top_n: int, offset: int,
                        echoed: tuple[list[int], list, str] | None = None, as_ids: bool = False,
                        ) -> dict[str, Any] | None:
    """The legacy completions' logprobs object; ``echoed`` = (prompt ids, their RequestOutput.prompt_logprobs,
    the first token's text) puts the prompt's tokens first (``echo``: the first token has no logprob, as in
    OpenAI's and vLLM's API). ``as_ids`` (vLLM's return_tokens_as_token_ids) names each token "token_id:{id}";
    text_offset still counts the text's characters."""
    if c.logprobs is None:
        return None
    pairs = list(zip(c.token_ids, c.logprobs, strict=False))
    first = ""
    if echoed is not None:
        ids, entries, first = echoed
        pairs = list(zip(ids, entries, strict=True)) + pairs
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, entry in pairs:
        if entry is None:  # the echoed prompt's first token: text, no logprob
            text = first
            token_lps.append(None)
            tops.append(None)
        else:
            chosen = entry[tok]
            text = chosen.decoded_token or ""
            token_lps.append(_lp(chosen.logprob))
            tops.append(_tops(entry, top_n, as_ids) if top_n else None)
        tokens.append(f"token_id:{tok}" if as_ids else text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _name(tok: int, lp: Any, as_ids: bool) -> str:
    """A logprob entry's token as the response names it: its text, or "token_id:{id}"."""
    return f"token_id:{tok}" if as_ids else (lp.decoded_token or "")


def _tops(entry: dict, top_n: int, as_ids: bool = False) -> dict[str, float]:
    return {_name(t, lp, as_ids): _lp(lp.logprob)
            for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_n}


def prompt_logprobs_json(pl: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM's servers return them: per prompt token, null for the first, then
    {token id: {logprob, rank, decoded_token}}."""
    if pl is None:
        return None
    return [None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in pl]


def chat_logprobs(c: CompletionOutput, top_n: int, as_ids: bool = False) -> dict[str, Any] | None:
    """The chat logprobs object; ``as_ids`` names each token "token_id:{id}" (its bytes are that name's)."""
    if c.logprobs is None:
        return None
    content = []
    for tok, entry in zip(c.token_ids, c.logprobs, strict=False):
        text = _name(tok, entry[tok], as_ids)
        top = [{"token": (name := _name(t, lp, as_ids)), "logprob": _lp(lp.logprob),
                "bytes": list(name.encode("utf-8", "replace"))}
               for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_n]
        content.append({"token": text, "logprob": _lp(entry[tok].logprob),
                        "bytes": list(text.encode("utf-8", "replace")), "top_logprobs": top})
    return {"content": content}

"""OpenAI-compatible HTTP server: FastAPI routes over the thread-stepped engine (engine_client.AsyncEngine).

Every refusal is an OpenAI-style JSON error ({"error": {"message", "type", "param", "code"}}) with a 4xx
status, raised before the request reaches the engine, so a bad request never disturbs the others. A client
that goes away (stream closed, or a non-streamed request's connection dropped) aborts its requests, and the
engine frees their blocks at its next iteration.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpage.entrypoints.openai.engine_client import AsyncEngine, EngineDeadError, QueueFullError
from kvpage.entrypoints.openai.metrics import ServerMetrics
from kvpage.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from kvpage.outputs import CompletionOutput, RequestOutput
from kvpage.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_n: int = 16


@dataclass
class _Job:
    """One engine request of an HTTP request: prompt index, its token ids, and its engine request id."""

    index: int
    request_id: str
    prompt_ids: list[int]


def build_app(client: AsyncEngine, config: ServerConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    app = FastAPI(title="kvpage", version="0.1.0", docs_url=None, redoc_url=None)
    engine = client.engine
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    vocab = engine.worker.lm.config.vocab_size
    metrics = metrics or ServerMetrics(config.model_name)
    if client.on_step is None:
        client.on_step = metrics.on_step
    created = int(time.time())

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {config.api_key}":
            what = "missing" if not header else "wrong"
            raise APIError(401, f"{what} API key: send 'Authorization: Bearer <key>'", "authentication_error")

    async def parse(request: Request, model: type[M]) -> M:
        check_auth(request)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            raise APIError(400, f"{loc}: {err['msg']}", param=loc) from None

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {config.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def check_ids(ids: list[int]) -> list[int]:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="prompt")
        return ids

    def check_lengths(prompt_len: int, max_tokens: int | None) -> int:
        """The effective max_tokens; 413 for a prompt that leaves no room, 400 for impossible max_tokens."""
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if prompt_len >= max_model_len:
            raise APIError(413, f"the prompt has {prompt_len} tokens; max_model_len is {max_model_len}, which leaves "
                                "no room to generate", param="prompt", code="context_length_exceeded")
        room = max_model_len - prompt_len
        if max_tokens is None:
            return room
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be an integer >= 1, got {max_tokens}", param="max_tokens")
        if max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} with a prompt of {prompt_len} tokens exceeds "
                                f"max_model_len={max_model_len} (at most {room} here)", param="max_tokens")
        return max_tokens

    def common_checks(req: SamplingFields) -> None:
        check_model(req.model)
        if req.n > config.max_n:
            raise APIError(400, f"n={req.n} exceeds this server's limit of {config.max_n}", param="n")
        if req.n < 1:
            raise APIError(400, f"n must be >= 1, got {req.n}", param="n")

    async def start(jobs: list[_Job], params: list[SamplingParams], cache_salt: str | None,
                    outputs: asyncio.Queue) -> None:
        """Submit every job; on any refusal abort those already accepted and raise the matching APIError."""
        accepted: list[str] = []
        try:
            for job, p in zip(jobs, params, strict=True):
                await client.submit(job.request_id, job.prompt_ids, p, outputs, cache_salt)
                accepted.append(job.request_id)
        except BaseException as e:
            for rid in accepted:
                client.abort(rid)
            if isinstance(e, QueueFullError):
                raise APIError(429, str(e), "rate_limit_error") from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), "server_error") from None
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            raise
        for job in jobs:
            metrics.add_prompt_tokens(len(job.prompt_ids))

    async def stream_outputs(request: Request, jobs: list[_Job],
                             outputs: asyncio.Queue) -> AsyncIterator[tuple[_Job, RequestOutput]]:
        """(job, output) until every job finished. A client disconnect, or the consumer stopping early, aborts
        the unfinished jobs at once (the engine frees their blocks at its next iteration)."""
        by_id = {j.request_id: j for j in jobs}
        open_ids = set(by_id)
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            while open_ids:
                get = asyncio.ensure_future(outputs.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    raise APIError(499, "client disconnected")
                item = get.result()
                if isinstance(item, BaseException):
                    raise APIError(503, str(item), "server_error")
                if item.request_id not in open_ids:
                    continue
                if item.finished:
                    open_ids.discard(item.request_id)
                yield by_id[item.request_id], item
        finally:
            gone.cancel()
            for rid in open_ids:
                client.abort(rid)

    async def until_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def collect(request: Request, jobs: list[_Job], outputs: asyncio.Queue) -> dict[str, RequestOutput]:
        """Final outputs of every job (aborted, with a 499, if the client disconnects first)."""
        final: dict[str, RequestOutput] = {}
        async with aclosing(stream_outputs(request, jobs, outputs)) as it:
            async for job, out in it:
                if out.finished:
                    final[job.request_id] = out
        return final

    def usage(jobs: list[_Job], completion_tokens: int, cached: int) -> dict[str, Any]:
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def completion_logprobs(c: CompletionOutput, top_n: int, offset: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, entry in zip(c.token_ids, c.logprobs, strict=False):
            chosen = entry[tok]
            text = chosen.decoded_token or ""
            tokens.append(text)
            token_lps.append(chosen.logprob)
            tops.append({(lp.decoded_token or ""): lp.logprob
                         for _, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_n}
                        if top_n else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(c: CompletionOutput, top_n: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        content = []
        for tok, entry in zip(c.token_ids, c.logprobs, strict=False):
            chosen = entry[tok]
            text = chosen.decoded_token or ""
            top = [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                    "bytes": list((lp.decoded_token or "").encode())}
                   for _, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_n]
            content.append({"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()),
                            "top_logprobs": top})
        return {"content": content}

    async def changes(request: Request, jobs: list[_Job],
                      outputs: asyncio.Queue) -> AsyncIterator[tuple[_Job, RequestOutput, CompletionOutput]]:
        """Each completion that has something new (text, tokens or its finish) in a delta output."""
        async with aclosing(stream_outputs(request, jobs, outputs)) as it:
            async for job, out in it:
                for c in out.outputs:
                    if c.text or c.token_ids or c.finish_reason is not None:
                        yield job, out, c

    def sse_response(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        """Server-sent events ending in [DONE]; an engine failure mid-stream becomes an error event (a client
        that disconnected reads nothing, and its jobs are already aborted)."""
        async def body() -> AsyncIterator[str]:
            try:
                async with aclosing(events) as it:
                    async for obj in it:
                        yield sse(obj)
            except APIError as e:
                if e.status == 499:
                    return
                yield sse(e.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> Response:
        if not client.alive:
            raise APIError(503, client.error or "engine not running", "server_error")
        return JSONResponse({})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": created, "owned_by": "kvpage",
            "root": config.model_name, "max_model_len": max_model_len}]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            conv = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = tokenizer.encode(tokenizer.apply_chat_template(conv, req.add_generation_prompt),
                                   add_special_tokens=False)
        else:
            ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse(request, DetokenizeRequest)
        check_model(req.model)
        return JSONResponse({"prompt": tokenizer.decode(check_ids(req.tokens), skip_special_tokens=False)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        common_checks(req)
        req.check()
        base = f"cmpl-{uuid.uuid4().hex}"
        jobs, params = [], []
        for i, prompt in enumerate(req.prompts()):
            if isinstance(prompt, str):
                ids = tokenizer.encode(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = check_ids(list(prompt))
            else:
                raise APIError(400, "prompt must be a string, a list of token ids, or a list of either",
                               param="prompt")
            max_tokens = check_lengths(len(ids), req.max_tokens)
            jobs.append(_Job(i, f"{base}-{i}", ids))
            params.append(req.sampling_params(max_tokens, req.logprobs, req.stream))
        top_n = req.logprobs or 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        model = config.model_name

        def choice(job: _Job, c: CompletionOutput, offset: int) -> dict[str, Any]:
            return {"index": job.index * req.n + c.index, "text": c.text,
                    "logprobs": completion_logprobs(c, top_n, offset), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}

        def frame(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": base, "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": choices, **extra}

        outputs: asyncio.Queue = asyncio.Queue()
        await start(jobs, params, req.cache_salt, outputs)
        if not req.stream:
            finals = await collect(request, jobs, outputs)
            choices, n_out, cached = [], 0, 0
            for job in jobs:
                out = finals[job.request_id]
                if out.error:
                    raise APIError(500, out.error, "server_error")
                cached += out.num_cached_tokens
                for c in out.outputs:
                    choices.append(choice(job, c, 0))
                    n_out += len(c.token_ids)
            choices.sort(key=lambda ch: ch["index"])
            return JSONResponse(frame(choices, usage=usage(jobs, n_out, cached)))

        async def events() -> AsyncIterator[dict[str, Any]]:
            n_out, cached, offsets = 0, {}, {}
            async with aclosing(changes(request, jobs, outputs)) as it:
                async for job, out, c in it:
                    cached[job.request_id] = out.num_cached_tokens
                    key = (job.index, c.index)
                    n_out += len(c.token_ids)
                    yield frame([choice(job, c, offsets.get(key, 0))])
                    offsets[key] = offsets.get(key, 0) + len(c.text)
            if include_usage:
                yield frame([], usage=usage(jobs, n_out, sum(cached.values())))

        return sse_response(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        common_checks(req)
        req.check()
        try:
            text = tokenizer.apply_chat_template(req.conversation(), req.add_generation_prompt)
        except APIError:
            raise
        except Exception as e:  # the template itself refused the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = check_lengths(len(ids), req.requested_max_tokens())
        base = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [_Job(0, f"{base}-0", ids)]
        params = [req.sampling_params(max_tokens, req.requested_logprobs(), req.stream)]
        top_n = req.top_logprobs or 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        model = config.model_name

        def frame(choices: list[dict[str, Any]], obj: str = "chat.completion.chunk", **extra: Any) -> dict[str, Any]:
            return {"id": base, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
                    **extra}

        outputs: asyncio.Queue = asyncio.Queue()
        await start(jobs, params, req.cache_salt, outputs)
        if not req.stream:
            finals = await collect(request, jobs, outputs)
            out = finals[jobs[0].request_id]
            if out.error:
                raise APIError(500, out.error, "server_error")
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(c, top_n), "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason} for c in out.outputs]
            n_out = sum(len(c.token_ids) for c in out.outputs)
            return JSONResponse(frame(choices, "chat.completion", usage=usage(jobs, n_out, out.num_cached_tokens)))

        async def events() -> AsyncIterator[dict[str, Any]]:
            n_out, cached = 0, 0
            for i in range(req.n):
                yield frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async with aclosing(changes(request, jobs, outputs)) as it:
                async for _, out, c in it:
                    cached = out.num_cached_tokens
                    n_out += len(c.token_ids)
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield frame([{"index": c.index, "delta": delta, "logprobs": chat_logprobs(c, top_n),
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
            if include_usage:
                yield frame([], usage=usage(jobs, n_out, cached))

        return sse_response(events())

    return app

"""OpenAI-compatible HTTP server: FastAPI routes over the thread-stepped engine (engine_client.AsyncEngine).

Every refusal is an OpenAI-style JSON error ({"error": {"message", "type", "param", "code"}}) with a 4xx
status, raised before the request reaches the engine, so a bad request never disturbs the others. A request
that fails inside the engine fails alone (500 JSON, or an error event in its stream). A client that goes
away (stream closed, or a non-streamed request's connection dropped) aborts its requests, and the engine
frees their blocks at its next iteration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpage import __version__
from kvpage.entrypoints.openai.admin import install as install_admin
from kvpage.entrypoints.openai.dashboard import install as install_dashboard
from kvpage.entrypoints.openai.engine_client import AsyncEngine
from kvpage.entrypoints.openai.http_input import InputLimits, check_auth, parse
from kvpage.entrypoints.openai.keep_alive import SSEKeepAlive
from kvpage.entrypoints.openai.messages_api import install as install_messages
from kvpage.entrypoints.openai.metrics import ServerMetrics
from kvpage.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    conversation,
)
from kvpage.entrypoints.openai.responses import install as install_responses
from kvpage.entrypoints.openai.serving import (
    ChatRun,
    Job,
    RequestRunner,
    api_error,
    best_samples,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    request_ids,
    sse_response,
    stream_usage,
    usage,
)
from kvpage.entrypoints.openai.tools import ToolReply, parse_tools
from kvpage.errors import EngineDeadError, QueueFullError, RequestRejected, ShuttingDownError
from kvpage.model.chat_template import compile_chat_template
from kvpage.outputs import CompletionOutput

logger = logging.getLogger(__name__)

# Texts longer than this are tokenized off the event loop, so one long prompt does not stall every stream.
_THREAD_TOKENIZE_CHARS = 20_000


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_n: int = 16
    limits: InputLimits = field(default_factory=InputLimits)
    chat_template: str | None = None  # --chat-template's text; None: the model's own
    trust_request_chat_template: bool = False  # serve a request's own chat_template (vLLM's flag of that name)
    openapi: bool = True  # /openapi.json, behind the API key like every route but /health, /ping, /version and /metrics
    dashboard: bool = True  # /dashboard: the live KV pool page, its snapshot and event stream (dashboard.py)
    tool_parser: str | None = None  # reads tool calls out of "auto" replies (--enable-auto-tool-choice; tools.py)
    # CORS, as vLLM's server defaults it (every origin, method and header; no credentials): browser clients on
    # other origins can call the API (the key still guards it); no origins: no CORS headers at all
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id, background runs, GET (0: none)
    responses_store_memory: int | None = 256 * 2**20  # about this much of their text at most (None: no limit)
    responses_store_file: str | None = None  # where they are kept across restarts (store_file.py), and what it held
    responses_saved: Any = None
    sse_keep_alive_interval: float = 0.0  # a beat on event streams silent this long (keep_alive.py; 0: none)


def build_app(client: AsyncEngine, config: ServerConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    app = FastAPI(title="kvpage", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    engine = client.engine
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    metrics = metrics or ServerMetrics(config.model_name)
    if client.on_step is None:
        client.on_step = metrics.on_step
    metrics.on_step(client, [], 0.0)  # gauges exist from start-up, not from the first request
    runner = RequestRunner(client, metrics)
    created = int(time.time())
    install_admin(app, client, config.api_key)
    if config.dashboard:
        install_dashboard(app, client, config.model_name, config.api_key)
    app.add_middleware(SSEKeepAlive, interval=config.sse_keep_alive_interval)  # a no-op at 0
    if config.allowed_origins:  # answers preflights before any route (and so before the key check)
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def _engine_error(_: Request, e: Exception) -> JSONResponse:
        """kvpage's typed errors (a refused request, a full queue, a drain, a dead engine) as api_error maps them,
        wherever a route lets one through."""
        err = api_error(e)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    for kind in (RequestRejected, QueueFullError, ShuttingDownError, EngineDeadError):
        app.add_exception_handler(kind, _engine_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        logger.error("request failed: %s: %s", type(e).__name__, e, exc_info=e)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", "server_error").body(),
                            status_code=500)

    async def body(request: Request, model: type[Any]) -> Any:
        return await parse(request, model, config.api_key, config.limits)

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {config.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    async def encode(text: str, param: str, **kwargs: Any) -> list[int]:
        """Token ids of ``text``; whatever the tokenizer refuses is the client's 400, not a 500."""
        try:
            if len(text) > _THREAD_TOKENIZE_CHARS:
                return await asyncio.to_thread(tokenizer.encode, text, **kwargs)
            return tokenizer.encode(text, **kwargs)
        except Exception as e:
            raise APIError(400, f"{param}: the text could not be tokenized: {e}", param=param) from None

    async def render_chat(conversation: list[dict[str, str]], req: ChatTemplateFields) -> str:
        """The prompt text; a client's own template renders on a worker thread, so one that loops for long does
        not stop the event loop (it still shares the interpreter with it)."""
        if req.chat_template is None:
            return render_sync(conversation, req)
        return await asyncio.to_thread(render_sync, conversation, req)

    def render_sync(conversation: list[dict[str, str]], req: ChatTemplateFields) -> str:
        req.check_template_fields()
        extra = dict(req.chat_template_kwargs or {})
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "chat_template",
                    "continue_final_message", "documents", *(["tools"] if req.tools else [])} & set(extra)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)} (the request sets them, or "
                                "its fields of those names do)", param="chat_template_kwargs")
        template = config.chat_template
        if req.chat_template is not None:
            if not config.trust_request_chat_template:
                raise APIError(400, "chat_template in a request is refused: this server runs its own template "
                                    "(start it with --trust-request-chat-template to take the client's)",
                               param="chat_template")
            try:
                compile_chat_template(req.chat_template)
            except ValueError as e:
                raise APIError(400, str(e), param="chat_template") from None
            template = req.chat_template
        if req.documents is not None:
            extra["documents"] = req.documents
        if req.tools:
            extra["tools"] = parse_tools(req.tools)
        if not (template or tokenizer.chat_template):
            raise APIError(400, "this model has no chat template: send a plain prompt to /v1/completions, or start "
                                "the server with --chat-template", param="messages")
        try:
            return tokenizer.apply_chat_template(conversation, req.add_generation_prompt, chat_template=template,
                                                 continue_final_message=req.continue_final_message, **extra)
        except APIError:
            raise
        except Exception as e:  # the template itself refused the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    async def chat_prompt(req: ChatCompletionRequest) -> list[int]:
        """A chat's prompt token ids, rendered by the template and tokenized."""
        text = await render_chat(req.conversation(), req)
        return await encode(text, "messages", add_special_tokens=req.add_special_tokens)

    def truncate(ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
        if keep is None:
            return ids
        if keep == -1:
            keep = max_model_len - 1
        if keep < 1:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or >= 1, got {keep}",
                           param="truncate_prompt_tokens")
        return ids[:keep] if side == "right" else ids[-keep:]

    def common_checks(req: SamplingFields) -> None:
        check_model(req.model)
        if req.priority != 0 and engine.scheduler.config.policy != "priority":
            raise APIError(400, f"priority {req.priority} needs a server started with --scheduling-policy priority "
                                "(this one serves first come, first served)", param="priority")
        if abs(req.priority) >= 2**63:
            raise APIError(400, f"priority must fit in 64 bits, got {req.priority}", param="priority")
        if req.n > config.max_n:
            raise APIError(400, f"n={req.n} exceeds this server's limit of {config.max_n}", param="n")
        if req.n < 1:
            raise APIError(400, f"n must be >= 1, got {req.n}", param="n")
        if req.beam_width() > config.max_n:
            what = "a beam width" if req.use_beam_search else "best_of"
            raise APIError(400, f"{what} of {req.beam_width()} exceeds this server's limit of {config.max_n}",
                           param="best_of")

    async def start_chat(req: ChatCompletionRequest, prefix: str = "chatcmpl") -> ChatRun:
        """Check, render, tokenize and submit a chat (chat completions and /v1/responses)."""
        common_checks(req)
        req.check()
        plan = req.tool_plan()
        plan.check_served(config.tool_parser)
        if plan.kind == "auto":  # the parser's markers may be special tokens
            req.skip_special_tokens = False
        ids = truncate(await chat_prompt(req), req.truncate_prompt_tokens, req.truncation_side)
        max_tokens = engine.check_request(len(ids), req.requested_max_tokens(), fit_context=True)
        base, job_base = request_ids(prefix, req)
        run = ChatRun(base, [Job(0, f"{job_base}-0", ids)], asyncio.Queue(),
                      [ToolReply(plan, config.tool_parser) for _ in range(req.n)])
        params = [req.sampling_params(max_tokens, req.requested_logprobs(), req.stream)]
        await runner.start(run.jobs, params, req.cache_salt, run.outputs, req.priority,
                           "tools" if plan.constraint() is not None else "structured_outputs")
        return run

    # ------------------------------------------------------------------ routes
    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json")
    async def openapi(request: Request) -> Response:
        check_auth(request, config.api_key)
        if not config.openapi:
            raise APIError(404, "the OpenAPI schema is turned off on this server", "not_found_error")
        return JSONResponse(get_openapi(title=app.title, version=app.version, routes=app.routes))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request, config.api_key)
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": created, "owned_by": "kvpage",
            "root": config.model_name, "max_model_len": max_model_len}]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await body(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            bos = "add_special_tokens" in req.model_fields_set and req.add_special_tokens  # a chat's default: none
            ids = await encode(await render_chat(conversation(req.messages), req), "messages", add_special_tokens=bos)
        else:
            ids = await encode(req.prompt or "", "prompt", add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await body(request, DetokenizeRequest)
        check_model(req.model)
        ids = engine.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await body(request, CompletionRequest)
        common_checks(req)
        req.check()
        base, job_base = request_ids("cmpl", req)
        jobs, params, texts = [], [], {}
        for i, prompt in enumerate(req.prompts()):
            if isinstance(prompt, str):
                ids = await encode(prompt, "prompt", add_special_tokens=req.add_special_tokens)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = engine.check_token_ids(prompt)
            else:
                raise APIError(400, "prompt must be a string, a list of token ids, or a list of either",
                               param="prompt")
            ids = truncate(ids, req.truncate_prompt_tokens, req.truncation_side)
            max_tokens = engine.check_request(len(ids), 1 if req.echo_only else req.max_tokens, fit_context=True)
            jobs.append(Job(i, f"{job_base}-{i}", ids))
            params.append(req.sampling_params(max_tokens, req.logprobs, req.stream))
            if req.echo:  # the prompt as the client sent it, or (token ids, a truncated prompt) its tokens' text
                texts[i] = prompt if isinstance(prompt, str) and req.truncate_prompt_tokens is None else \
                    tokenizer.decode(ids, skip_special_tokens=False)
        top_n, as_ids = req.logprobs or 0, bool(req.return_tokens_as_token_ids)
        include_usage, every_chunk = stream_usage(req)
        model = config.model_name

        def choice(job: Job, c: CompletionOutput, offset: int, pl: list | None, first: bool) -> dict[str, Any]:
            """``first``: the choice's first chunk (or its whole body), which carries the echoed prompt."""
            if req.echo_only:  # the engine's one token stays out
                c = CompletionOutput(c.index, "", [], c.cumulative_logprob, [] if c.logprobs is not None else None,
                                     c.finish_reason, c.stop_reason)
            echo = req.echo and first
            ids = job.prompt_ids
            echoed = (ids, pl, tokenizer.decode(ids[:1], skip_special_tokens=False)) if echo and pl else None
            out = {"index": job.index * req.n + c.index, "text": (texts[job.index] if echo else "") + c.text,
                   "logprobs": completion_logprobs(c, top_n, offset, echoed, as_ids), "finish_reason": c.finish_reason,
                   "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                out["prompt_logprobs"] = prompt_logprobs_json(pl)
            if req.return_token_ids:  # the prompt's with a choice's first chunk (or whole body), as vLLM
                out["prompt_token_ids"] = list(ids) if first else None
                out["token_ids"] = list(c.token_ids)
            return out

        def frame(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": base, "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": choices, **extra}

        outputs: asyncio.Queue = asyncio.Queue()
        await runner.start(jobs, params, req.cache_salt, outputs, req.priority)
        if not req.stream:
            finals = await runner.collect(request, jobs, outputs)
            choices, n_out, cached = [], 0, 0
            for job in jobs:
                out = finals[job.request_id]
                cached += out.num_cached_tokens
                # every sample's tokens were generated, those of samples best_of leaves out too
                n_out += 0 if req.echo_only else sum(len(c.token_ids) for c in out.outputs)
                for c in best_samples(out.outputs, req) if req.ranked_samples() else out.outputs:
                    choices.append(choice(job, c, 0, out.prompt_logprobs, True))
            choices.sort(key=lambda ch: ch["index"])
            return JSONResponse(frame(choices, usage=usage(jobs, n_out, cached)))

        async def events() -> AsyncIterator[dict[str, Any]]:
            n_out, cached, offsets, pls = 0, {}, {}, {}
            async with aclosing(runner.changes(request, jobs, outputs)) as it:
                async for job, out, c in it:
                    cached[job.request_id] = out.num_cached_tokens
                    if out.prompt_logprobs is not None:  # in one delta output only
                        pls[job.request_id] = out.prompt_logprobs
                    key = (job.index, c.index)
                    n_out += 0 if req.echo_only else len(c.token_ids)
                    extra = {"usage": usage(jobs, n_out, sum(cached.values()))} if every_chunk else {}
                    ch = choice(job, c, offsets.get(key, 0), pls.get(job.request_id), key not in offsets)
                    yield frame([ch], **extra)
                    offsets[key] = offsets.get(key, 0) + len(ch["text"])
            if include_usage:
                yield frame([], usage=usage(jobs, n_out, sum(cached.values())))

        return sse_response(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await body(request, ChatCompletionRequest)
        run = await start_chat(req)
        base, jobs, outputs, replies = run.id, run.jobs, run.outputs, run.replies
        prompt_ids = {"prompt_token_ids": jobs[0].prompt_ids} if req.return_token_ids else {}

        def token_ids(c: CompletionOutput) -> dict[str, Any]:
            return {"token_ids": list(c.token_ids)} if req.return_token_ids else {}
        top_n, as_ids = req.top_logprobs or 0, bool(req.return_tokens_as_token_ids)
        echoed = req.echoed()
        include_usage, every_chunk = stream_usage(req)
        model = config.model_name

        def frame(choices: list[dict[str, Any]], obj: str = "chat.completion.chunk", **extra: Any) -> dict[str, Any]:
            return {"id": base, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
                    **extra}

        if not req.stream:
            finals = await runner.collect(request, jobs, outputs)
            out = finals[jobs[0].request_id]
            choices = []
            for c in out.outputs:
                msg, reason = replies[c.index].message(echoed + c.text, c.finish_reason)
                choices.append({"index": c.index, "message": {"role": "assistant", **msg}, "finish_reason": reason,
                                "logprobs": chat_logprobs(c, top_n, as_ids), "stop_reason": c.stop_reason,
                                **token_ids(c)})
            n_out = sum(len(c.token_ids) for c in out.outputs)
            pl = out.prompt_logprobs
            extra = {} if req.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_json(pl)}
            return JSONResponse(frame(choices, "chat.completion", usage=usage(jobs, n_out, out.num_cached_tokens),
                                      **extra, **prompt_ids))

        async def events() -> AsyncIterator[dict[str, Any]]:
            n_out, cached = 0, 0
            for i in range(req.n):
                yield frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], **(prompt_ids if i == 0 else {}))
                if echoed:
                    yield frame([{"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}])
            async with aclosing(runner.changes(request, jobs, outputs)) as it:
                async for _, out, c in it:
                    cached = out.num_cached_tokens
                    n_out += len(c.token_ids)
                    delta, reason = replies[c.index].delta(c.text, c.finish_reason)
                    extra = {"usage": usage(jobs, n_out, cached)} if every_chunk else {}
                    yield frame([{"index": c.index, "delta": delta, "logprobs": chat_logprobs(c, top_n, as_ids),
                                  "finish_reason": reason, "stop_reason": c.stop_reason, **token_ids(c)}],
                                **extra)
            if include_usage:
                yield frame([], usage=usage(jobs, n_out, cached))

        return sse_response(events())

    app.state.stores = install_responses(app, body, start_chat, runner, config)  # (responses, conversations)
    metrics.watch_stores(**dict(zip(("responses", "conversations"), app.state.stores, strict=True)))
    install_messages(app, body, start_chat, chat_prompt, runner, config.model_name)
    return app

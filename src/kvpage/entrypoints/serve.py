"""``kvpage serve``: the OpenAI-compatible HTTP server on the paged-KV engine."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpage import envs
from kvpage.engine.arg_utils import EngineArgs, size_gib_default

# --tool-call-parser's choices: the forms openai/tool_parsers.py reads (not imported: it needs the serve extras)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "functiongemma")

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions (streamed or not), /v1/models, /tokenize, "
                    "/detokenize, /health, /version and Prometheus /metrics on the paged-KV engine.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and "
                                     "/openapi.json (also from $KVPAGE_API_KEY or --api-key-file, which keep it "
                                     "out of the process list)")
    p.add_argument("--api-key-file", type=Path, help="read the API key from this file (its first line)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds open requests may run before they are failed (default 30)")
    p.add_argument("--http-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, and then its body (default 30)")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="largest request body accepted, refused with 413 while it is read (default 16 MiB)")
    p.add_argument("--no-openapi", action="store_true", help="do not serve /openapi.json")
    p.add_argument("--no-dashboard", action="store_true",
                   help="do not serve /dashboard (the live KV pool page) and its snapshot and event stream")
    p.add_argument("--max-queue", type=int, help="answer 429 once this many requests wait to be scheduled")
    p.add_argument("--max-n", type=int, default=16, help="largest n (samples per request) accepted")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    p.add_argument("--chat-template", help="a Jinja chat template for /v1/chat/completions and /tokenize, as a "
                                           "file or inline (default: the model's own)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="serve a request's own chat_template field (refused by default)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="read tool calls out of replies to chats with tools and tool_choice 'auto' (needs "
                        "--tool-call-parser); without it 'auto', the default with tools, is refused with a 400")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="the form the model writes tool calls in: hermes = <tool_call>{\"name\": ..., "
                        "\"arguments\": {...}}</tool_call> (Hermes, Qwen 2.5 / 3 templates); llama3_json = the reply "
                        "is {\"name\": ..., \"parameters\": {...}} objects (Llama 3.1 / 3.2 JSON templates); "
                        "pythonic = the reply is [f(a=1), g()] (Llama 3.2 / 4 pythonic templates)")
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        p.add_argument(f"--allowed-{flag}", type=json_list(f"--allowed-{flag}"), default=["*"],
                       help=f"CORS: the {what} browsers may call the API from, a JSON list (default [\"*\"]: any, "
                            "as vLLM's server; --allowed-origins '[]' sends no CORS headers)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send cookies and credentials (not with --allowed-origins '[\"*\"]')")
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="/v1/responses kept in memory for previous_response_id, background runs and GET "
                        "/v1/responses/{id}, the oldest finished dropped first (default 1024; 0 keeps none)")
    p.add_argument("--responses-store-memory", default="256MiB",
                   help="about how much of their text (conversations, input items, background runs' events) the "
                        "stored responses may hold, the oldest finished dropped first (bare number = GiB; default "
                        "256MiB)")
    p.add_argument("--responses-store-file", default=None, metavar="FILE",
                   help="keep stored responses and conversations across restarts: written to FILE when the server "
                        "stops, read back when it starts (default: none, they live in memory only)")
    p.add_argument("--sse-keep-alive-interval", type=float, default=0.0,
                   help="seconds of silence after which a streamed response gets a keep-alive beat (an SSE comment; "
                        "Anthropic's ping event on /v1/messages), so that proxies with an idle timeout do not close "
                        "streams that wait in the queue or in a long prefill (default 0: none, as vLLM's server)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineArgs.add_cli_args(p)
    # A server's defaults, as vLLM's CPU server chooses them: 128 sequences per step keep the time per output
    # token down under load (measured with vLLM's client: 108 ms against 192 ms at 256 on the AMX Xeon, and
    # more tokens per second), and the KV pages are faulted in at startup rather than during the first
    # requests (first touch of 2 GiB took ~4 s on that VM).
    p.set_defaults(func=run, max_num_seqs=128, kv_prefault=True)


def json_list(flag: str) -> Callable[[str], list[str]]:
    """A flag's value as a JSON list of strings (vLLM's spelling: --allowed-origins '["https://ui.example"]')."""
    def parse(value: str) -> list[str]:
        try:
            items = json.loads(value)
        except json.JSONDecodeError:
            items = None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', got {value!r}")
        return items
    return parse


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or $KVPAGE_API_KEY (at most one of the first two)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text().splitlines()[0].strip() if args.api_key_file.stat().st_size else ""
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file} holds no key on its first line")
        return key
    key = args.api_key if args.api_key is not None else envs.read("KVPAGE_API_KEY") or None
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return key


def run(args: argparse.Namespace) -> int:
    if args.max_queue is not None and args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_n < 1:
        raise ValueError(f"--max-n must be >= 1, got {args.max_n}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("shutdown_timeout", "http_timeout", "sse_keep_alive_interval"):
        if not getattr(args, flag) >= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0 seconds, got {getattr(args, flag)}")
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    saved = None
    if args.responses_store_file is not None:  # read before the model loads: a bad file stops start-up at once
        from kvpage.entrypoints.openai.store_file import read
        saved = read(args.responses_store_file)
    try:
        args.responses_store_memory = size_gib_default(args.responses_store_memory)
    except ValueError as e:
        raise ValueError(f"--responses-store-memory: {e}") from None
    if args.responses_store_memory <= 0:
        raise ValueError("--responses-store-memory must be more than 0 bytes (--responses-store-size 0 keeps no "
                         "responses)")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if args.allow_credentials and "*" in args.allowed_origins:
        raise ValueError("--allow-credentials needs --allowed-origins to name the origins (browsers refuse "
                         "credentials with a '*' origin)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    key = api_key(args)
    from kvpage.model.chat_template import resolve_chat_template

    template = None if args.chat_template is None else resolve_chat_template(args.chat_template)
    try:
        import uvicorn  # noqa: F401

        from kvpage.entrypoints.openai.api_server import ServerConfig
        from kvpage.entrypoints.openai.http_input import InputLimits
    except ImportError as e:
        raise RuntimeError(f"the server needs its extras: pip install 'kvpage[serve]' ({e})") from None
    from kvpage.engine.llm_engine import LLMEngine

    engine_args = EngineArgs.from_cli_args(args)
    parallel = engine_args.parallel_config()
    if parallel is not None and not parallel.leads:  # another host's ranks: follow node 0 until it stops
        from kvpage.worker.follower import run_node

        return run_node(parallel, engine_args.model_config(), engine_args.cache_config())
    config = ServerConfig(args.served_model_name or "", key, args.max_n,
                          InputLimits(args.max_body_bytes, args.http_timeout), openapi=not args.no_openapi,
                          dashboard=not args.no_dashboard, chat_template=template,
                          trust_request_chat_template=args.trust_request_chat_template,
                          tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                          allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                          responses_store_size=args.responses_store_size,
                          responses_store_memory=args.responses_store_memory,
                          responses_store_file=args.responses_store_file, responses_saved=saved,
                          sse_keep_alive_interval=args.sse_keep_alive_interval)
    return serve_engine(lambda: LLMEngine(engine_args), config, args.host, args.port, max_queue=args.max_queue,
                        shutdown_timeout=args.shutdown_timeout, http_timeout=args.http_timeout,
                        log_level=args.uvicorn_log_level)


def serve_engine(engine, config, host: str, port: int, max_queue: int | None = None,
                 shutdown_timeout: float = 30.0, http_timeout: float = 30.0, log_level: str = "warning") -> int:
    """Serve ``engine`` (an LLMEngine's factory, called on the engine thread, or an engine) over HTTP until a
    signal (exit code 0) or the engine's death (1). An empty ``config.model_name`` takes the model's name."""
    import uvicorn

    from kvpage.entrypoints.openai.api_server import build_app
    from kvpage.entrypoints.openai.engine_client import AsyncEngine
    from kvpage.entrypoints.openai.lifecycle import InflightCounter, KVServer, header_timeout_protocol
    from kvpage.entrypoints.openai.metrics import ServerMetrics

    client = AsyncEngine(engine, max_queue)
    engine = client.engine
    if not config.model_name:
        config.model_name = engine.model_config.name
    metrics = ServerMetrics(config.model_name)
    client.on_step = metrics.on_step
    app = build_app(client, config, metrics)
    inflight = InflightCounter(app)
    uv_config = uvicorn.Config(inflight, host=host, port=port, log_level=log_level,
                               http=header_timeout_protocol(http_timeout) if http_timeout > 0 else "h11",
                               lifespan="off")
    server = KVServer(uv_config, client, inflight, shutdown_timeout)
    print(f"kvpage: serving {config.model_name} on http://{host}:{port} (max_model_len {engine.max_model_len}, "
          f"{engine.kv.num_blocks} KV blocks of {engine.kv.block_size} tokens)", file=sys.stderr, flush=True)
    # Everything built so far (model, tokenizer, app) lives as long as the server: out of the collector's sight,
    # so its full collections, which hold the GIL against both threads, walk only what requests allocate
    # (gc_collect_main was 1.6-2.6% of the engine thread's samples under `vllm bench serve` before).
    gc.freeze()
    try:
        server.run()
    finally:
        client.shutdown()
        engine.shutdown()  # the other tensor-parallel ranks, if any
        if config.responses_store_file:
            save_stores(config.responses_store_file, *app.state.stores)
    if server.exit_code:
        print(f"kvpage: exiting with {server.exit_code}: {client.error}", file=sys.stderr, flush=True)
    else:
        print(f"kvpage: stopped; {engine.kv.stats().used_blocks} KV blocks in use", file=sys.stderr, flush=True)
    return server.exit_code


def save_stores(path: str, responses: Any, conversations: Any) -> None:
    """--responses-store-file: what the stores hold, written as the server stops (store_file.py)."""
    from kvpage.entrypoints.openai.store_file import write

    try:
        n_resp, n_conv = write(path, responses, conversations)
    except OSError as e:
        print(f"kvpage: could not write --responses-store-file {path}: {e}", file=sys.stderr, flush=True)
        return
    print(f"kvpage: kept {n_resp} responses and {n_conv} conversations in {path}", file=sys.stderr, flush=True)

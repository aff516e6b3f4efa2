"""``kvpage serve``: the OpenAI-compatible HTTP server on the paged-KV engine."""

from __future__ import annotations

import argparse
import logging
import sys

from kvpage.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions (streamed or not), /v1/models, /tokenize, "
                    "/detokenize, /health and Prometheus /metrics on the paged-KV engine.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize")
    p.add_argument("--max-queue", type=int, help="answer 429 once this many requests wait to be scheduled")
    p.add_argument("--max-n", type=int, default=16, help="largest n (samples per request) accepted")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_queue is not None and args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_n < 1:
        raise ValueError(f"--max-n must be >= 1, got {args.max_n}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    try:
        import uvicorn

        from kvpage.entrypoints.openai.api_server import ServerConfig, build_app
        from kvpage.entrypoints.openai.engine_client import AsyncEngine
        from kvpage.entrypoints.openai.metrics import ServerMetrics
    except ImportError as e:
        raise RuntimeError(f"the server needs its extras: pip install 'kvpage[serve]' ({e})") from None
    from kvpage.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    name = args.served_model_name or engine.worker.lm.config.name
    metrics = ServerMetrics(name)
    client = AsyncEngine(engine, args.max_queue, metrics.on_step)
    app = build_app(client, ServerConfig(name, args.api_key, args.max_n), metrics)
    print(f"kvpage: serving {name} on http://{args.host}:{args.port} (max_model_len {engine.max_model_len}, "
          f"{engine.kv.num_blocks} KV blocks of {engine.kv.block_size} tokens)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        client.shutdown()
    return 0

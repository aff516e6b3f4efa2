"""The server's operator routes, as vLLM's server names them: health (/health, and /ping for load balancers that
probe that path), the load (/load), the version, forgetting the prefix cache, and pausing generation (/pause,
/resume, /is_paused).

/health, /ping and /version are open (probes carry no key); the rest sit behind the API key. A pause holds new
requests instead of refusing them (they reach the engine in order on /resume), so clients see a slow answer,
never an error; an operator drains or freezes the engine without dropping connections.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpage import __version__
from kvpage.entrypoints.openai.engine_client import PAUSE_MODES, AsyncEngine
from kvpage.entrypoints.openai.http_input import check_auth
from kvpage.entrypoints.openai.protocol import APIError


def _flag(request: Request, name: str, default: bool) -> bool:
    """A boolean query parameter (true / false / 1 / 0), a 400 naming it otherwise."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = {"true": True, "1": True, "false": False, "0": False}.get(raw.lower())
    if value is None:
        raise APIError(400, f"{name} must be true or false, got {raw!r}", param=name)
    return value


def install(app: FastAPI, client: AsyncEngine, api_key: str | None) -> None:
    async def health() -> Response:
        if not client.alive:
            raise APIError(503, client.error or "engine not running", "server_error")
        if client.draining is not None:
            raise APIError(503, client.draining, "server_error")
        return JSONResponse({})

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # SageMaker's and some balancers' probe path

    @app.get("/load")
    async def load(request: Request) -> Response:
        """vLLM's load figure for balancers: the requests the engine holds (running, waiting, swapped, held by a
        pause, or submitted and not yet taken); a request with n > 1 counts n."""
        check_auth(request, api_key)
        return JSONResponse({"server_load": client.num_open})

    @app.get("/version")
    async def version() -> Response:  # as vLLM's server answers it; open, like /health
        return JSONResponse({"version": __version__})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """Forget every cached prefix block: the pool, the host and the disk tier (vLLM's admin endpoint)."""
        check_auth(request, api_key)
        n = await client.call(lambda eng: eng.reset_prefix_cache())
        return JSONResponse({"status": "ok", "entries_cleared": n})

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        """?mode=abort (default: open requests end with finish reason "abort"), wait (they run to their end:
        answered once they have) or keep (they stay, blocks and all, until /resume); ?clear_cache=true forgets
        the prefix cache once nothing runs (not with keep)."""
        check_auth(request, api_key)
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
        clear = _flag(request, "clear_cache", False)
        if clear and mode == "keep":
            raise APIError(400, "clear_cache cannot go with mode=keep: the kept requests hold cached blocks",
                           param="clear_cache")
        await client.pause(mode, clear)
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        check_auth(request, api_key)
        await client.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused(request: Request) -> Response:
        check_auth(request, api_key)
        return JSONResponse({"is_paused": client.paused})

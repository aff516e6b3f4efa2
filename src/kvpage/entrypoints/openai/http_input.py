"""Everything between the socket and a validated request model: the API key, the body (bounded in size and in
time while it is read), and JSON bounded in depth and number size, with strings that the tokenizer can take.

Each refusal is an APIError with a 4xx status that names the problem; none of them reaches the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvpage.entrypoints.openai.protocol import APIError, refuse_unsupported

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 32  # the deepest real request (chat content parts) is 5 levels
MAX_NUMBER_CHARS = 40  # token ids, seeds and counts fit in 20 digits; floats in 25 characters


@dataclass(frozen=True)
class InputLimits:
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = 30.0  # seconds to receive a whole body once its headers are in


def check_auth(request: Request, api_key: str | None) -> None:
    """Constant-time comparison of 'Authorization: Bearer KEY', or of 'x-api-key: KEY' as Anthropic's clients send
    it (no timing hint about how much matched)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    if hmac.compare_digest(header.encode("utf-8", "surrogateescape"), f"Bearer {api_key}".encode()):
        return
    other = request.headers.get("x-api-key")
    if other is not None and hmac.compare_digest(other.encode("utf-8", "surrogateescape"), api_key.encode()):
        return
    what = "missing" if not header and other is None else "wrong"
    raise APIError(401, f"{what} API key: send 'Authorization: Bearer <key>'", "authentication_error")


async def read_body(request: Request, limits: InputLimits) -> bytes:
    """The body, refused with 413 as soon as it passes the limit (a declared Content-Length is checked before
    anything is read) and with 408 if it does not arrive in time; never buffered past the limit."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit() or len(declared) > 20:
            raise APIError(400, f"malformed Content-Length header: {declared[:40]!r}")
        if int(declared) > limits.max_body_bytes:
            raise APIError(413, f"request body of {int(declared)} bytes exceeds the {limits.max_body_bytes}-byte "
                                "limit")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise APIError(413, f"request body exceeds the {limits.max_body_bytes}-byte limit")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout:g} s",
                       code="request_timeout") from None
    return b"".join(chunks)


class _BadNumber(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _BadNumber(f"an integer of {len(text)} digits (at most {MAX_NUMBER_CHARS} characters per number)")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _BadNumber(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"the number {text} is out of range")
    return value


def _parse_constant(name: str) -> float:
    raise _BadNumber(f"{name} is not valid JSON (numbers must be finite)")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for malformed JSON, non-finite or oversized numbers, nesting deeper than
    MAX_JSON_DEPTH and strings holding lone UTF-16 surrogates (which no tokenizer can encode)."""
    try:
        data = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except _BadNumber as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    escapes = b"\\ud" in raw or b"\\uD" in raw  # a surrogate can only arrive as a \u escape
    if deep or escapes:
        _walk(data, escapes)
    return data


def _walk(data: Any, strings: bool) -> None:
    """Iterative: depth of every container and, if asked, that every string is valid Unicode."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        obj, depth, path = stack.pop()
        if isinstance(obj, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels",
                               param=path or None)
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for key, value in items:
                where = f"{path}.{key}" if path else str(key)
                if strings and isinstance(key, str):
                    _check_text(key, where)
                if isinstance(value, dict | list) or (strings and isinstance(value, str)):
                    stack.append((value, depth + 1, where))
        elif isinstance(obj, str):
            _check_text(obj, path)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{where or 'body'}: the text holds a lone UTF-16 surrogate ({text[e.start]!r} at "
                            f"character {e.start}), which is not valid Unicode", param=where or None) from None


async def parse(request: Request, model: type[M], api_key: str | None, limits: InputLimits) -> M:
    """Authenticate, read, parse, refuse what cannot be honoured, and validate into ``model``."""
    check_auth(request, api_key)
    data = parse_json(await read_body(request, limits))
    refuse_unsupported(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        raise APIError(400, f"{loc}: {err['msg']}", param=loc) from None
    except RecursionError:
        raise APIError(400, f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None

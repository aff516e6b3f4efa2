"""Tool-call parsers for tool_choice "auto" (``--enable-auto-tool-choice --tool-call-parser NAME``): where a
model's reply holds calls, in the form its chat template taught it, and how many characters of a streamed reply
may go out as text before the reply shows whether a call starts there.

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, after any text (Hermes, Qwen 2.5 / 3
               templates); the last block may be left open at the end of the reply;
  llama3_json  the reply is the calls: an optional <|python_tag|>, then {"name": ..., "parameters": {...}} objects
               ("arguments" is read too) separated by ";" (Llama 3.1 / 3.2 JSON tool templates);
  pythonic     the reply is a Python list of calls with keyword arguments of literal values,
               [weather(city="Paris"), time()] (Llama 3.2 / 4 pythonic templates, and Gemma 3 templates that teach it).
A reply whose calls do not all parse, or name a function the request does not offer, stays text with no calls.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Calls = tuple[str | None, list[dict[str, Any]]]  # (the reply's text outside the calls, or None; the calls)

_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """A call as the API returns it: the arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def hermes_calls(text: str, names: set[str]) -> Calls:
    at = text.find(_HERMES_OPEN)
    if at < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[at:]):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return text, []
        calls.append(make_call(obj["name"], obj.get("arguments", {})))
    content = text[:at]
    return (content if content.strip() else None), calls


def llama3_json_calls(text: str, names: set[str]) -> Calls:
    rest = text.strip()
    rest = rest.removeprefix(_PYTHON_TAG).lstrip()
    if not rest.startswith("{"):
        return text, []
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return text, []
        args = obj.get("parameters", obj.get("arguments", {})) if isinstance(obj, dict) else None
        if not isinstance(args, dict) or obj.get("name") not in names:
            return text, []
        calls.append(make_call(obj["name"], args))
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return None, calls


def pythonic_calls(text: str, names: set[str]) -> Calls:
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List):
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and node.func.id in names and all(k.arg is not None for k in node.keywords)):
                return text, []
            calls.append(make_call(node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text, []
    return None, calls


@dataclass(frozen=True)
class CallForm:
    """A parser: what opens a call, whether a call may follow text (else only the reply's start may open one),
    and the reader of (text, calls)."""

    opens: tuple[str, ...]
    after_text: bool
    read: Callable[[str, set[str]], Calls]

    def sendable(self, text: str) -> int:
        """How much of a reply so far may stream as text: up to the first opener, or to a trailing piece that may
        still become one; for calls at the start only, nothing while the reply may still open a call."""
        if not self.after_text:
            head = text.lstrip()
            if not head or any(head.startswith(o) or o.startswith(head) for o in self.opens):
                return 0
            return len(text)
        found = [at for at in (text.find(o) for o in self.opens) if at >= 0]
        if found:
            return min(found)
        partial = [len(text) - k for o in self.opens for k in range(min(len(o) - 1, len(text)), 0, -1)
                   if text.endswith(o[:k])]
        return min(partial, default=len(text))


PARSERS = {
    "hermes": CallForm((_HERMES_OPEN,), True, hermes_calls),
    "llama3_json": CallForm((_PYTHON_TAG, "{"), False, llama3_json_calls),
    "pythonic": CallForm(("[",), False, pythonic_calls),
}
TOOL_CALL_PARSERS = tuple(PARSERS)  # --tool-call-parser's choices

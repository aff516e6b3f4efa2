"""Tool-call parsers for tool_choice "auto" (``--enable-auto-tool-choice --tool-call-parser NAME``): where a
model's reply holds calls, in the form its chat template taught it, and how many characters of a streamed reply
may go out as text before the reply shows whether a call starts there.

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, after any text (Hermes, Qwen 2.5 / 3
               templates); the last block may be left open at the end of the reply;
  llama3_json  the reply is the calls: an optional <|python_tag|>, then {"name": ..., "parameters": {...}} objects
               ("arguments" is read too) separated by ";" (Llama 3.1 / 3.2 JSON tool templates);
  pythonic     the reply is a Python list of calls with keyword arguments of literal values,
               [weather(city="Paris"), time()] (Llama 3.2 / 4 pythonic templates, and Gemma 3 templates that teach it);
  mistral      [TOOL_CALLS] after any text, then name[ARGS]{...} or name{...} per call, each call after its own
               [TOOL_CALLS] (v11+ tokenizers), or one JSON list of {"name", "arguments"} objects (earlier ones); the
               calls get the 9-letter alphanumeric ids Mistral's templates demand;
  qwen3_coder  <tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call> blocks after any
               text (Qwen3-Coder / Qwen3.5 XML templates); a value is read as its parameter's schema type says
               (string as written, integer, number, boolean, null, object / array as JSON), else as text; the last
               block, function or parameter may be left open at the end of the reply.
  functiongemma <start_function_call>call:NAME{key:<escape>text<escape>,n:3,opts:{...},xs:[...]}<end_function_call>
               after any text (FunctionGemma, Gemma 3 270M tuned for calls); escaped text is read as its parameter's
               schema type says, as qwen3_coder's values; the last call may be left open at the end of the reply.
A reply whose calls do not all parse, or name a function the request does not offer, stays text with no calls.
Readers take the request's functions by name (a name's schema types qwen3_coder's values).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Calls = tuple[str | None, list[dict[str, Any]]]  # (the reply's text outside the calls, or None; the calls)
Functions = Mapping[str, dict[str, Any]]  # the request's functions by name ({"name", "parameters", ...})

_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any, id_: str | None = None) -> dict[str, Any]:
    """A call as the API returns it: the arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": id_ or call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def hermes_calls(text: str, names: Functions) -> Calls:
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


def llama3_json_calls(text: str, names: Functions) -> Calls:
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


def pythonic_calls(text: str, names: Functions) -> Calls:
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


_TOOL_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*")
_ALNUM = string.ascii_letters + string.digits


def mistral_id() -> str:
    """Mistral's templates refuse a call id that is not 9 letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _json_object_at(text: str) -> dict[str, Any] | None:
    """The one JSON object that is all of ``text`` (surrounding blanks aside), else None."""
    try:
        obj, end = json.JSONDecoder().raw_decode(text.strip())
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and not text.strip()[end:].strip() else None


def mistral_calls(text: str, names: Functions) -> Calls:
    at = text.find(_TOOL_CALLS)
    if at < 0:
        return text, []
    calls = []
    for part in text[at + len(_TOOL_CALLS):].split(_TOOL_CALLS):
        body = part.strip()
        if body.startswith("["):  # before v11: one JSON list of {"name", "arguments"} objects
            try:
                items = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(items, list) or not items:
                return text, []
            for it in items:
                if not (isinstance(it, dict) and it.get("name") in names and isinstance(it.get("arguments", {}), dict)):
                    return text, []
                calls.append(make_call(it["name"], it.get("arguments", {}), mistral_id()))
            continue
        m = _MISTRAL_NAME.match(body)
        if m is None or m.group(1) not in names:
            return text, []
        rest = body[m.end():]
        if rest.startswith(_CALL_ID):  # v13 templates echo an id before the arguments
            rest = rest[len(_CALL_ID):]
            rest = rest[rest.find(_ARGS):] if _ARGS in rest else rest[rest.find("{"):]
        args = _json_object_at(rest.removeprefix(_ARGS))
        if args is None:
            return text, []
        calls.append(make_call(m.group(1), args, mistral_id()))
    content = text[:at]
    return (content if content.strip() else None), calls


_QWEN_OPEN, _QWEN_FUNCTION = "<tool_call>", "<function="
_QWEN_CALL = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|(?=<function=)|$)", re.DOTALL)
_QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_QWEN_SHELL = re.compile(r"\s*(?:</?tool_call>\s*)*")  # what may lie between and around the functions


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as its schema's type (text when it names none, or does not parse)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return value
    raw = value.strip()
    if raw == "null":
        return None
    for k in kinds:
        try:
            if k == "integer":
                return int(raw)
            if k == "number":
                num = float(raw)
                return int(raw) if num.is_integer() and raw.lstrip("-").isdigit() else num
            if k == "boolean" and raw.lower() in ("true", "false"):
                return raw.lower() == "true"
            if k in ("object", "array"):
                try:
                    return json.loads(raw)
                except json.JSONDecodeError:
                    return ast.literal_eval(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


def qwen3_coder_calls(text: str, functions: Functions) -> Calls:
    opens = [at for at in (text.find(_QWEN_OPEN), text.find(_QWEN_FUNCTION)) if at >= 0]
    if not opens:
        return text, []
    at = min(opens)
    calls, pos, body = [], 0, text[at:]
    for m in _QWEN_CALL.finditer(body):
        if not _QWEN_SHELL.fullmatch(body[pos:m.start()]):
            return text, []
        pos = m.end()
        name = m.group(1).strip()
        if name not in functions:
            return text, []
        props = (functions[name].get("parameters") or {}).get("properties") or {}
        args = {}
        for p in _QWEN_PARAM.finditer(m.group(2)):
            key, value = p.group(1).strip(), p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, props.get(key))
        calls.append(make_call(name, args))
    if not calls or not _QWEN_SHELL.fullmatch(body[pos:]):
        return text, []
    content = text[:at]
    return (content if content.strip() else None), calls


_FG_OPEN, _FG_CLOSE, _FG_ESC = "<start_function_call>", "<end_function_call>", "<escape>"
_FG_CALL = re.compile(r"<start_function_call>call:([A-Za-z0-9_.-]+)")
_FG_BARE = re.compile(r"[^,}\]]*")


def _fg_value(s: str, i: int, schema: Any) -> tuple[Any, int]:
    """One FunctionGemma argument value at ``s[i:]`` and where it ends: <escape>text<escape> (read as its schema's
    type, like qwen3_coder's values), {key:value,...}, [value,...], or a bare literal (number, true, false, null; a
    bare word that is none of those is read as escaped text is)."""
    if s.startswith(_FG_ESC, i):
        end = s.find(_FG_ESC, i + len(_FG_ESC))
        if end < 0:
            raise ValueError("an <escape> is not closed")
        return _typed(s[i + len(_FG_ESC):end], schema), end + len(_FG_ESC)
    if s.startswith("{", i):
        props = (schema or {}).get("properties") or {} if isinstance(schema, dict) else {}
        return _fg_object(s, i, props)
    if s.startswith("[", i):
        items, i = [], i + 1
        item_schema = schema.get("items") if isinstance(schema, dict) else None
        while not s.startswith("]", i):
            value, i = _fg_value(s, i, item_schema)
            items.append(value)
            if s.startswith(",", i):
                i += 1
            elif not s.startswith("]", i):
                raise ValueError("a list item is not followed by , or ]")
        return items, i + 1
    m = _FG_BARE.match(s, i)
    raw = m.group(0) if m else ""
    if not raw.strip():
        raise ValueError("an argument has no value")
    try:
        return json.loads(raw), i + len(raw)
    except json.JSONDecodeError:  # an unescaped word: text, or its schema's type
        return _typed(raw.strip(), schema), i + len(raw)


def _fg_object(s: str, i: int, props: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``{key:value,...}`` at ``s[i]``, and where it ends."""
    out, i = {}, i + 1
    while not s.startswith("}", i):
        colon = s.find(":", i)
        if colon < 0 or not re.fullmatch(r"[A-Za-z0-9_.-]+", s[i:colon]):
            raise ValueError("an argument name is not followed by :")
        key = s[i:colon]
        out[key], i = _fg_value(s, colon + 1, props.get(key))
        if s.startswith(",", i):
            i += 1
        elif not s.startswith("}", i):
            raise ValueError("an argument is not followed by , or }")
    return out, i + 1


def functiongemma_calls(text: str, functions: Functions) -> Calls:
    at = text.find(_FG_OPEN)
    if at < 0:
        return text, []
    calls, pos = [], at
    while pos < len(text):
        m = _FG_CALL.match(text, pos)
        if m is None or m.group(1) not in functions or not text.startswith("{", m.end()):
            return text, []
        props = (functions[m.group(1)].get("parameters") or {}).get("properties") or {}
        try:
            args, pos = _fg_object(text, m.end(), props)
        except (ValueError, json.JSONDecodeError, RecursionError):
            return text, []
        calls.append(make_call(m.group(1), args))
        rest = text[pos:].lstrip()
        rest = rest[len(_FG_CLOSE):].lstrip() if rest.startswith(_FG_CLOSE) else rest
        if not rest:
            break
        if not rest.startswith(_FG_OPEN):
            return text, []
        pos = len(text) - len(rest)
    content = text[:at]
    return (content if content.strip() else None), calls


@dataclass(frozen=True)
class CallForm:
    """A parser: what opens a call, whether a call may follow text (else only the reply's start may open one),
    and the reader of (text, calls)."""

    opens: tuple[str, ...]
    after_text: bool
    read: Callable[[str, Functions], Calls]

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
    "mistral": CallForm((_TOOL_CALLS,), True, mistral_calls),
    "qwen3_coder": CallForm((_QWEN_OPEN, _QWEN_FUNCTION), True, qwen3_coder_calls),
    "functiongemma": CallForm((_FG_OPEN,), True, functiongemma_calls),
}
TOOL_CALL_PARSERS = tuple(PARSERS)  # --tool-call-parser's choices

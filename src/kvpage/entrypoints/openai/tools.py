"""Tool calling on chat completions, as OpenAI's API and vLLM's server define it.

A request's ``tools`` reach the chat template (as transformers hands them over), and ``tool_choice`` decides what
the reply may be:
  - "none": text; "auto" (the default when tools are given): text, or tool calls where the model wrote calls in the
    form of the server's tool-call parser (``--enable-auto-tool-choice --tool-call-parser NAME``: tool_parsers.py);
    a server without one refuses "auto" (a 400 naming tool_choice, as vLLM's server answers), since calls would
    come back as text;
  - a named function ({"type": "function", "function": {"name": ...}}): the output is constrained to a JSON object
    of that function's parameters (structured outputs) and comes back as one call, finish reason as generated
    ("stop", as OpenAI answers a forced call);
  - "required": the output is constrained to a JSON array of {"name", "parameters"} objects, one of the tools
    each (at most one with parallel_tool_calls: false), and comes back as calls, finish reason "tool_calls".
Assistant messages carrying ``tool_calls`` go to the template with each call's arguments as an object (templates
print them with tojson), tool messages with their ``tool_call_id``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvpage.entrypoints.openai.protocol import APIError
from kvpage.entrypoints.openai.tool_parsers import PARSERS, call_id, make_call
from kvpage.sampling_params import StructuredOutputsParams


def _object_schema(params: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments are a JSON object; one that declares no parameters takes the empty object (an open
    object let small models fill it with made-up keys until max_tokens)."""
    return params if params else {"type": "object", "properties": {}, "additionalProperties": False}


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """The request's ``tools`` checked: function tools with a name and, if any, an object schema (400 naming the
    tool otherwise). None when the request has none."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise APIError(400, "tools must be a non-empty list of function tools (or left out)", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{where}: only function tools are supported ({{'type': 'function', 'function': "
                                "{'name': ..., 'parameters': {...}}})", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}.function needs a name", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
        if fn["name"] in names:
            raise APIError(400, f"{where}: the function name {fn['name']!r} is used twice", param="tools")
        names.add(fn["name"])
    return [{**t, "type": "function"} for t in value]


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of its output: kind is "none", "auto", "required" or "named"."""

    tools: list[dict[str, Any]] | None = None
    kind: str = "none"
    name: str | None = None  # the named function
    parallel: bool = True

    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools or []}

    def check_served(self, parser: str | None) -> None:
        """400 for "auto" on a server that cannot read calls out of a reply."""
        if self.kind == "auto" and parser is None:
            raise APIError(400, "tool_choice 'auto' (the default with tools) needs a server started with "
                                "--enable-auto-tool-choice --tool-call-parser: send tool_choice 'none', 'required' or "
                                "a named function", param="tool_choice")

    @cached_property
    def _constraint(self) -> StructuredOutputsParams | None:
        return self._build_constraint()

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output a named or required choice runs under (None for none / auto); built once, so the
        compiled grammar's key is computed once too."""
        return self._constraint

    def _build_constraint(self) -> StructuredOutputsParams | None:
        if self.kind == "named":
            return StructuredOutputsParams(json=_object_schema(self.functions()[self.name].get("parameters")))
        if self.kind != "required":
            return None
        one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                    "parameters": _object_schema(fn.get("parameters"))},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, fn in self.functions().items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)


def tool_plan(tools: Any, choice: Any, parallel: bool | None) -> ToolPlan:
    """The request's tools and tool_choice checked and resolved (400 naming the field)."""
    parsed = parse_tools(tools)
    if choice is None:
        choice = "auto" if parsed else "none"
    if choice == "none":
        return ToolPlan(parsed, "none")
    if parsed is None:
        raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice in ("auto", "required"):
        return ToolPlan(parsed, choice, parallel=parallel is not False)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                            "{'name': ...}}", param="tool_choice")
    if fn["name"] not in {t["function"]["name"] for t in parsed}:
        raise APIError(400, f"tool_choice names {fn['name']!r}, which is not among the tools", param="tool_choice")
    return ToolPlan(parsed, "named", fn["name"], parallel is not False)


def template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant message's tool_calls with each call's arguments as an object, as chat templates take them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list):
        raise APIError(400, f"messages[{index}].tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"messages[{index}].tool_calls[{j}] needs function.name", param="messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise APIError(400, f"messages[{index}].tool_calls[{j}].function.arguments is not JSON",
                               param="messages") from None
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": out}


def _required_calls(text: str) -> list[dict[str, Any]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    return [make_call(it["name"], it.get("parameters", {})) for it in items
            if isinstance(it, dict) and isinstance(it.get("name"), str)]


@dataclass
class ToolReply:
    """One choice's text as a chat message under a ToolPlan: whole (``message``) or streamed (``delta``)."""

    plan: ToolPlan
    parser: str | None = None  # the server's tool-call parser ("auto" plans have one: ToolPlan.check_served)
    _sent: str = ""  # content streamed so far ("auto": the text before any call)
    _text: str = ""  # all text so far
    _named_open: bool = False  # the named call's id and name went out

    def _parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        kind = self.plan.kind
        if kind == "named":
            return None, [make_call(self.plan.name or "", text)]
        if kind == "required":
            return None, _required_calls(text)
        if kind == "auto":
            content, calls = PARSERS[self.parser or ""].read(text, self.plan.functions())
            return content, calls if self.plan.parallel else calls[:1]
        return text, []

    def _reason(self, finish_reason: str | None, calls: list) -> str | None:
        if calls and finish_reason == "stop" and self.plan.kind in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the message's content / tool_calls, the choice's finish reason)."""
        if self.plan.kind == "none":
            return {"content": text}, finish_reason
        content, calls = self._parse(text)
        if not calls:
            return {"content": text}, finish_reason
        return {"content": content, "tool_calls": calls}, self._reason(finish_reason, calls)

    def delta(self, text: str, finished: str | None) -> tuple[dict[str, Any], str | None]:
        """The stream's delta for this piece of text (``finished``: the choice's finish reason once it ends)."""
        kind = self.plan.kind
        if kind == "none":
            return ({"content": text} if text or finished is None else {}), finished
        self._text += text
        if kind == "named":  # the arguments stream as they come, the call's id and name first
            if not text:
                return {}, finished
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self._named_open:
                self._named_open = True
                call = {"index": 0, "id": call_id(), "type": "function",
                        "function": {"name": self.plan.name, "arguments": text}}
            return {"tool_calls": [call]}, finished
        if kind == "auto":  # text streams up to a possible start of a call; calls go out when the choice ends
            held = PARSERS[self.parser or ""].sendable(self._text)
            out = self._text[len(self._sent):held]
            self._sent += out
            if finished is None:
                return ({"content": out} if out else {}), None
            calls = self._parse(self._text)[1]
            if not calls:  # no calls after all: the held text goes out as content
                rest = self._text[len(self._sent):]
                return ({"content": out + rest} if out + rest else {}), finished
            delta: dict[str, Any] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
            if out:
                delta["content"] = out
            return delta, self._reason(finished, calls)
        if finished is None:  # required: the array is parsed once it is complete
            return {}, None
        calls = _required_calls(self._text)
        if not calls:
            return ({"content": self._text} if self._text else {}), finished
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, self._reason(finished, calls)

"""xgrammar's structural tag "format" form (vLLM's ``structural_tag`` as ``{"type": "structural_tag", "format":
{...}}``) as a Lark grammar for llguidance.

A format is a tree: literals (``const_string``), JSON (``json_schema``), regular expressions (``regex``), free
text (``any_text``), compositions (``sequence``, ``or``, ``optional``, ``plus``, ``star``, ``repeat``), wrapped
regions (``tag``: begin, content, end) and free text with tagged regions that a trigger opens
(``triggered_tags``) or a bare list of tags (``tags_with_separator``). Free text cannot end by itself: inside a
tag it ends at the tag's end string (a lazy lexeme: the shortest text followed by an end), and elsewhere it
may only come last. Refused by name, never approximated: token-level formats, ``dispatch``, the XML parameter
styles, ``grammar`` inside a format, and ``any_text`` / ``triggered_tags`` limits (``excludes``,
``max_tokens``, ``max_chars``).
"""

from __future__ import annotations

import json
from typing import Any

_TEXT = "/(.|\\n)*/"
_UNSUPPORTED = {
    "token": "token-level formats", "exclude_token": "token-level formats", "any_tokens": "token-level formats",
    "token_triggered_tags": "token-level formats", "token_dispatch": "token-level formats",
    "dispatch": "dispatch", "qwen_xml_parameter": "XML parameter formats",
    "grammar": "a grammar inside a format (send it alone as structured_outputs.grammar)",
}
_MAX_REPEAT = 256  # a repeat's bounds are written out: larger ones are refused rather than blowing up the grammar
EOS = "eos"  # where a format comes last of all, so free text may run to the end of the output


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _one_of(texts: list[str]) -> str:
    """Any one of ``texts`` (a tag's end strings), as a Lark group of literals."""
    return "(" + " | ".join(_lit(t) for t in texts) + ")"


class _Builder:
    def __init__(self) -> None:
        self.rules: list[str] = []

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"f{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def build(self, fmt: Any, where: str, stop: list[str] | str | None) -> tuple[str, bool]:
        """(the Lark expression for ``fmt``, whether it already ends with one of ``stop``): ``stop`` is the end
        strings of the tag whose content ends with ``fmt``, EOS where nothing follows, None elsewhere."""
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ValueError(f"structural_tag {where} must be a format object with a type")
        kind = fmt["type"]
        if kind in _UNSUPPORTED:
            raise ValueError(f"structural_tag {where}: {_UNSUPPORTED[kind]} ({kind!r}) are not supported")
        method = getattr(self, f"_{kind}", None)
        if method is None:
            raise ValueError(f"structural_tag {where}: unknown format type {kind!r}")
        return method(fmt, where, stop)

    # ------------------------------------------------------------------ primitives
    def _const_string(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        return _lit(_string(fmt, "value", where)), False

    def _json_schema(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        schema = fmt.get("json_schema")
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict | bool):
            raise ValueError(f"structural_tag {where}.json_schema must be a JSON schema object")
        if fmt.get("style", "json") != "json" or fmt.get("any_order"):
            raise ValueError(f"structural_tag {where}: only style 'json' in declared order is supported")
        return f"%json {json.dumps(schema)}", False

    def _regex(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        return self.rule(_lark_regex(_string(fmt, "pattern", where))), False

    def _any_text(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        _no_limits(fmt, where, ("excludes", "max_tokens", "max_chars"))
        if isinstance(stop, list):  # the shortest text followed by one of the enclosing tag's ends
            return self.rule(f"{_TEXT} {_one_of(stop)}", lazy=True), True
        if stop == EOS:
            return self.rule(_TEXT), False
        raise ValueError(f"structural_tag {where}: any_text must end a tag's content or the whole format "
                         "(nothing else can tell where free text ends)")

    # ------------------------------------------------------------------ compositions
    def _sequence(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        elements = _formats(fmt, "elements", where)
        parts, ate = [], False
        for i, el in enumerate(elements):
            expr, ate = self.build(el, f"{where}.elements[{i}]", stop if i == len(elements) - 1 else None)
            parts.append(expr)
        return "(" + " ".join(parts) + ")", ate

    def _or(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        alts = [self.build(el, f"{where}.elements[{i}]", stop) for i, el in enumerate(_formats(fmt, "elements", where))]
        if isinstance(stop, list) and any(ate for _, ate in alts):  # every branch then ends with the tag's end
            return "(" + " | ".join(e if ate else f"{e} {_one_of(stop)}" for e, ate in alts) + ")", True
        return "(" + " | ".join(e for e, _ in alts) + ")", False

    def _repeated(self, fmt: dict, where: str) -> str:
        expr, _ = self.build(fmt.get("content"), f"{where}.content", None)
        return expr

    def _optional(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        return f"({self._repeated(fmt, where)})?", False

    def _plus(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        return f"({self._repeated(fmt, where)})+", False

    def _star(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        return f"({self._repeated(fmt, where)})*", False

    def _repeat(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        low, high = fmt.get("min"), fmt.get("max")
        if not isinstance(low, int) or not isinstance(high, int) or low < 0 or (high != -1 and high < low) \
                or max(low, high) > _MAX_REPEAT:
            raise ValueError(f"structural_tag {where}: repeat needs 0 <= min <= max <= {_MAX_REPEAT} (max -1: "
                             f"unbounded), got min {low!r}, max {high!r}")
        item = self.rule(self._repeated(fmt, where))
        body = [item] * low
        if high == -1:
            body.append(f"{item}*")
        else:
            body += [f"{item}?"] * (high - low)
        return "(" + " ".join(body) + ")" if body else '""', False

    # ------------------------------------------------------------------ tags
    def _tag(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        begin, _ = _tag_parts(fmt, where)
        return self.rule(f"{_lit(begin)} {self._tag_body(fmt, where)}"), False

    def _tag_body(self, fmt: dict, where: str) -> str:
        """A tag's content and end, as one rule (a triggered tag's two openings share it)."""
        _, ends = _tag_parts(fmt, where)
        content, ate = self.build(fmt.get("content"), f"{where}.content", ends)
        tail = "" if ate else " " + _one_of(ends)
        return self.rule(f"{content}{tail}")

    def _tags(self, fmt: dict, where: str) -> list[dict]:
        tags = fmt.get("tags")
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"structural_tag {where}.tags must be a non-empty list of tag formats")
        for i, t in enumerate(tags):
            if not isinstance(t, dict) or t.get("type", "tag") != "tag":
                raise ValueError(f"structural_tag {where}.tags[{i}] must be a tag format")
        return tags

    def _triggered_tags(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        _no_limits(fmt, where, ("excludes",))
        if stop != EOS:
            raise ValueError(f"structural_tag {where}: triggered_tags must come last of all (its free text "
                             "can only end with the output)")
        triggers = fmt.get("triggers")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"structural_tag {where}.triggers must be a non-empty list of non-empty strings")
        led, direct = [], []
        for i, tag in enumerate(self._tags(fmt, where)):
            at = f"{where}.tags[{i}]"
            begin, _ = _tag_parts(tag, at)
            matching = [t for t in triggers if begin.startswith(t)]
            if len(matching) != 1:
                raise ValueError(f"structural_tag {at}: begin {begin!r} must start with exactly one trigger, "
                                 f"{len(matching)} do")
            body = self._tag_body(tag, at)  # built once: a schema's grammar is not written twice
            lead = self.rule(f"{_TEXT} {_lit(matching[0])}", lazy=True)  # free text up to the trigger
            led.append(self.rule(f"{lead} {_lit(begin[len(matching[0]):])} {body}"))
            direct.append(self.rule(f"{_lit(begin)} {body}"))
        any_led, any_direct = "(" + " | ".join(led) + ")", "(" + " | ".join(direct) + ")"
        text = self.rule(_TEXT)
        first, once = bool(fmt.get("at_least_one")), bool(fmt.get("stop_after_first"))
        if first and once:
            return any_direct, False
        if first:
            return f"({any_direct} {any_led}* {text})", False
        if once:
            return f"({any_led} | {text})", False
        return f"({any_led}* {text})", False

    def _tags_with_separator(self, fmt: dict, where: str, stop: Any) -> tuple[str, bool]:
        sep = _lit(_string(fmt, "separator", where))
        one = self.rule(" | ".join(self._tag(t, f"{where}.tags[{i}]", None)[0]
                                   for i, t in enumerate(self._tags(fmt, where))))
        first, once = bool(fmt.get("at_least_one")), bool(fmt.get("stop_after_first"))
        if once:
            return (one if first else f"({one})?"), False
        return (f"({one} ({sep} {one})*)" if first else f"({one} ({sep} {one})*)?"), False


def _lark_regex(pattern: str) -> str:
    """``pattern`` as a Lark regex literal: its unescaped slashes escaped (an escaped one stays as it is)."""
    out, escaped = [], False
    for ch in pattern:
        out.append("\\/" if ch == "/" and not escaped else ch)
        escaped = ch == "\\" and not escaped
    return "/" + "".join(out) + "/"


def _string(fmt: dict, key: str, where: str) -> str:
    value = fmt.get(key)
    if not isinstance(value, str):
        raise ValueError(f"structural_tag {where}.{key} must be a string")
    return value


def _formats(fmt: dict, key: str, where: str) -> list:
    value = fmt.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"structural_tag {where}.{key} must be a non-empty list of formats")
    return value


def _no_limits(fmt: dict, where: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if fmt.get(key) not in (None, [], ()):
            raise ValueError(f"structural_tag {where}.{key} is not supported")


def _tag_parts(fmt: dict, where: str) -> tuple[str, list[str]]:
    begin, end = fmt.get("begin"), fmt.get("end")
    if not isinstance(begin, str):
        raise ValueError(f"structural_tag {where}.begin must be a string (token begins are not supported)")
    ends = [end] if isinstance(end, str) else end
    if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
        raise ValueError(f"structural_tag {where}.end must be a string or a non-empty list of strings")
    if any(e == "" for e in ends) and len(ends) > 1:
        raise ValueError(f"structural_tag {where}.end: an empty end string cannot stand beside others")
    return begin, ends


def format_grammar(tag: dict) -> str:
    """The Lark grammar (llguidance's dialect) of a structural tag in the format form."""
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag type must be 'structural_tag', got {tag.get('type')!r}")
    b = _Builder()
    expr, _ = b.build(tag.get("format"), "format", EOS)
    return "\n".join(["%llguidance {}", f"start: {expr}", *b.rules]) + "\n"

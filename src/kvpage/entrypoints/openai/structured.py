"""The request fields that constrain the output's form, as OpenAI and vLLM spell them, into one
``StructuredOutputsParams``: ``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` object
and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields."""

from __future__ import annotations

from typing import Any

from kvpage.entrypoints.openai.protocol import APIError
from kvpage.sampling_params import StructuredOutputsParams

# vLLM's structured_outputs keys that kvpage takes, and those it accepts only at their neutral values
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_NEUTRAL = {"disable_fallback": (None, False), "disable_any_whitespace": (None, False, True),
            "disable_additional_properties": (None, False), "whitespace_pattern": (None, ""),
            "_backend": (None,), "_backend_was_auto": (None, False, True)}


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, "response_format must be an object with a type: text, json_object, json_schema or "
                            "structural_tag",
                       param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "structural_tag":  # vLLM's: {"type": "structural_tag", "structures": [...], "triggers": [...]}
        return {"structural_tag": {k: v for k, v in value.items() if k != "type"}}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type {kind!r} is not supported: text, json_object, json_schema or "
                        "structural_tag",
                   param="response_format", code="unsupported_parameter")


def _from_structured_outputs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object (json, regex, choice, grammar, json_object or "
                            "structural_tag)",
                       param="structured_outputs")
    out = {}
    for key, item in value.items():
        if key in _KINDS:
            if item is not None and item is not False and not (key == "structural_tag" and item == ""):
                out[key] = item
        elif key not in _NEUTRAL or item not in _NEUTRAL[key]:
            raise APIError(400, f"structured_outputs.{key} is not supported by this server",
                           param="structured_outputs", code="unsupported_parameter")
    return out


def structured_params(fields: Any) -> StructuredOutputsParams | None:
    """The one constraint a request's fields ask for (None: free text); 400 when they ask for two, or for one
    this server cannot read."""
    asked: list[tuple[str, dict[str, Any]]] = []
    for name, found in (("response_format", _from_response_format(getattr(fields, "response_format", None))),
                        ("structured_outputs", _from_structured_outputs(getattr(fields, "structured_outputs", None)))):
        if found:
            asked.append((name, found))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(fields, f"guided_{kind}", None)
        if value is not None:
            asked.append((f"guided_{kind}", {kind: value}))
    if not asked:
        return None
    if len(asked) > 1 or len(asked[0][1]) > 1:
        names = [f"{n}.{k}" if n == "structured_outputs" else n for n, spec in asked for k in spec]
        raise APIError(400, f"ask for one output form at a time, got {', '.join(names)}", param=asked[-1][0])
    name, spec = asked[0]
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as e:
        raise APIError(400, str(e), param=name) from None

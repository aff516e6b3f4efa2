"""Chat templates: Hugging Face style Jinja, rendered in a sandbox and compiled once per template text.

Besides the model's own template a server or a caller may bring one (``--chat-template``: a file, or the
template inline), and a conversation may end in a message the model is to continue rather than answer
(``continue_final_message``, as transformers and vLLM define it: the template renders without a generation
prompt and the text is cut right after the last message's content, so whatever the template closes a turn
with is left out).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

# A value of --chat-template holding one of these is a template; anything else must name a file.
_JINJA_MARKS = ("{{", "{%", "{#")


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """tojson as transformers renders templates (tool schemas, call arguments): keys in their given order and no
    HTML escaping, where Jinja's own filter sorts keys and escapes '<', '>', '&' and quotes."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """The compiled template (a jinja2 Template); ValueError naming the syntax error. Compiling costs
    milliseconds, so each distinct text is compiled once, not once per request."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from None


def resolve_chat_template(value: str) -> str:
    """The template text that ``--chat-template VALUE`` means: the file VALUE names, or VALUE itself when it
    is Jinja. Checked here, so a bad template stops the command at start instead of failing every chat."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat template file {path} cannot be read: {e}") from None
    elif any(mark in value for mark in _JINJA_MARKS):
        text = value
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template (no '{{{{' or '{{%')")
    if not text.strip():
        raise ValueError(f"chat template {value!r} is empty")
    compile_chat_template(text)
    return text


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         continue_final_message: bool = False, **variables: Any) -> str:
    """Render a Hugging Face style Jinja chat template in a sandbox (ValueError for what it refuses)."""
    from jinja2 import TemplateError

    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the model "
                             "either continues the last message or starts a new one")
        if not messages or not isinstance(messages[-1].get("content"), str) or not messages[-1]["content"]:
            raise ValueError("continue_final_message needs a last message with text to continue")
    try:
        text = compile_chat_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                      **variables)
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
    if not continue_final_message:
        return text
    final = messages[-1]["content"]
    for piece in (final, final.strip()):
        at = text.rfind(piece) if piece else -1
        if at >= 0:
            return text[: at + len(piece)]
    raise ValueError("continue_final_message: the chat template does not reproduce the last message's text, "
                     "so there is no place to continue it from")

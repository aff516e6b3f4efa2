"""--chat-template's value (a file or the template inline), checked at start; templates compiled once."""

from __future__ import annotations

import pytest

from kvpage.model.chat_template import compile_chat_template, render_chat_template, resolve_chat_template

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_a_file_or_an_inline_template(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert resolve_chat_template(str(path)) == TEMPLATE
    assert resolve_chat_template(TEMPLATE) == TEMPLATE
    assert render_chat_template(TEMPLATE, [{"role": "user", "content": "hi"}], True) == "[user] hi\n"


@pytest.mark.parametrize(("value", "message"), [
    ("/no/such/template.jinja", "neither a file nor a Jinja template"),
    ("chatml", "neither a file nor a Jinja template"),
    ("{% for m in messages %}", "does not compile"),
])
def test_bad_values_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        resolve_chat_template(value)


def test_an_empty_or_unreadable_file_is_refused(tmp_path):
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_chat_template(str(empty))
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match="cannot be read"):
        resolve_chat_template(str(binary))


def test_each_template_text_compiles_once():
    assert compile_chat_template(TEMPLATE) is compile_chat_template(TEMPLATE)
    assert compile_chat_template(TEMPLATE + " ") is not compile_chat_template(TEMPLATE)

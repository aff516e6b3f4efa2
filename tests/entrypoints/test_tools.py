"""Tool calling's request checks, the output forms a tool choice imposes, and how replies become tool calls, whole
and streamed (openai/tools.py), without a server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from kvpage.entrypoints.openai import tool_parsers
from kvpage.entrypoints.openai.protocol import APIError, ChatCompletionRequest, conversation
from kvpage.entrypoints.openai.tool_parsers import (
    PARSERS,
    functiongemma_calls,
    hermes_calls,
    llama3_json_calls,
    mistral_calls,
    pythonic_calls,
    qwen3_coder_calls,
)
from kvpage.entrypoints.openai.tools import ToolPlan, ToolReply, tool_plan
from kvpage.entrypoints.serve import TOOL_CALL_PARSERS

WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters


def refused(param: str, words: str, fn, *args) -> None:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_the_cli_offers_the_parsers_the_module_reads():
    assert TOOL_CALL_PARSERS == tool_parsers.TOOL_CALL_PARSERS


def test_tool_choice_resolves_as_openai_defines_it():
    assert tool_plan(None, None, None).kind == "none"
    assert tool_plan([WEATHER], None, None).kind == "auto"  # tools alone: the model decides
    assert tool_plan([WEATHER], "none", None).kind == "none"
    assert tool_plan([WEATHER], "required", False).parallel is False
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "time"}}, None)
    assert (named.kind, named.name) == ("named", "time")


@pytest.mark.parametrize("tools, choice, param, words", [
    ([], None, "tools", "non-empty"),
    ("weather", None, "tools", "non-empty"),
    ([{"type": "code_interpreter"}], None, "tools", "only function tools"),
    ([{"type": "function", "function": {}}], None, "tools", "tools[0].function needs a name"),
    ([{"function": {"name": "f", "parameters": "{}"}}], None, "tools", "JSON schema object"),
    ([WEATHER, WEATHER], None, "tools", "used twice"),
    (None, "required", "tool_choice", "needs tools"),
    (None, {"type": "function", "function": {"name": "weather"}}, "tool_choice", "needs tools"),
    ([WEATHER], "sometimes", "tool_choice", "must be 'none', 'auto', 'required'"),
    ([WEATHER], {"type": "function"}, "tool_choice", "must be"),
    ([WEATHER], {"type": "function", "function": {"name": "time"}}, "tool_choice", "not among the tools"),
])
def test_bad_tools_and_choices_are_refused_by_name(tools, choice, param, words):
    refused(param, words, tool_plan, tools, choice, None)


def test_named_and_required_choices_constrain_the_output():
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "weather"}}, None).constraint()
    assert named.json == WEATHER["function"]["parameters"]
    no_params = tool_plan([TIME], {"type": "function", "function": {"name": "time"}}, None).constraint()
    assert no_params.json == {"type": "object", "properties": {}, "additionalProperties": False}
    schema = tool_plan([WEATHER, TIME], "required", None).constraint().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["weather"], ["time"]]
    assert tool_plan([WEATHER], "required", False).constraint().json["maxItems"] == 1
    assert tool_plan([WEATHER], "auto", None).constraint() is None
    assert tool_plan([WEATHER], "none", None).constraint() is None


def test_a_forced_call_takes_no_other_output_form():
    base = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    req = ChatCompletionRequest(**base, tool_choice="required", response_format={"type": "json_object"})
    refused("tool_choice", "constrains the output already", req.structured)
    auto = ChatCompletionRequest(**base, response_format={"type": "json_object"})
    assert auto.structured().json_object  # auto leaves the output free, so the client's form applies


def test_assistant_calls_reach_the_template_with_object_arguments():
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])
    conv = conversation(req.messages)
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conv[2] == {"role": "tool", "content": "18 C", "tool_call_id": "c1"}
    bad = ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [
        {"function": {"name": "weather", "arguments": "{city"}}]}])
    refused("messages", "arguments is not JSON", conversation, bad.messages)


def test_hermes_output_becomes_calls_and_anything_else_stays_text():
    names = {"weather", "time"}
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "time", "arguments": {}}')  # the last one left open at the end
    content, calls = hermes_calls(text, names)
    assert content == "Let me look.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Paris"}), ("time", {})]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert hermes_calls("no calls here", names) == ("no calls here", [])
    broken = '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>'
    assert hermes_calls(broken, names) == (broken, [])
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert hermes_calls(unknown, names) == (unknown, [])


def test_llama3_json_and_pythonic_replies_are_the_calls():
    names = {"weather", "time"}
    content, calls = llama3_json_calls('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; '
                                       '{"name": "time", "arguments": {}}', names)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
    for text in ('The answer is {"name": "weather"}', '{"name": "rm", "parameters": {}}',
                 '{"name": "weather", "parameters": "Oslo"}', '{"name": "weather", "parameters": {"city": "Os'):
        assert llama3_json_calls(text, names) == (text, []), text
    content, calls = pythonic_calls(' [weather(city="Oslo", days=[1, 2]), time()]\n', names)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo", "days": [1, 2]}), ("time", {})]
    for text in ("[weather(city=city_name)]", "[weather('Oslo')]", "[os.system(cmd='ls')]", "[rm()]",
                 "[weather(city='Oslo')", "Sure: [time()]", "[1, 2]", "[weather(**kw)]"):
        assert pythonic_calls(text, names) == (text, []), text


def named_args(calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_mistral_reads_each_tokenizer_generations_calls():
    fns = {"weather": WEATHER["function"], "time": TIME["function"]}
    content, calls = mistral_calls('Checking.[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]time[ARGS]{}', fns)
    assert content == "Checking." and named_args(calls) == [("weather", {"city": "Oslo"}), ("time", {})]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)  # Mistral's templates demand these ids
    for text in ('[TOOL_CALLS]weather{"city": "Oslo"}',  # the "{" alone ends the name
                 '[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}',  # v13: an id echoed first
                 '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]'):  # before v11: a JSON list
        content, calls = mistral_calls(text, fns)
        assert content is None and named_args(calls) == [("weather", {"city": "Oslo"})], text
    assert mistral_calls("no calls", fns) == ("no calls", [])
    for text in ("[TOOL_CALLS]rm[ARGS]{}", '[TOOL_CALLS]weather[ARGS]{"city": ', '[TOOL_CALLS]weather[ARGS]"Oslo"',
                 '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"} trailing', '[TOOL_CALLS][{"name": "rm", "arguments": {}}]',
                 "[TOOL_CALLS][]", '[TOOL_CALLS][{"name": "weather", "arguments": "Oslo"}]'):
        assert mistral_calls(text, fns) == (text, []), text


def test_qwen3_coder_reads_xml_calls_with_their_schema_types():
    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"},
        "note": {"type": ["integer", "null"]}}}
    fns = {"forecast": {"name": "forecast", "parameters": schema}, "time": TIME["function"]}
    text = ("Let me look.\n<tool_call>\n<function=forecast>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=temp>\n-2.5\n</parameter>\n<parameter=metric>\nTrue\n"
            "</parameter>\n<parameter=opts>\n{\"wind\": [1, 2]}\n</parameter>\n"
            "<parameter=hours>\n[6, 12]\n</parameter>\n"
            "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n007\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=time>\n</function>\n</tool_call>")
    content, calls = qwen3_coder_calls(text, fns)
    assert content == "Let me look.\n" and named_args(calls) == [
        ("forecast", {"city": "New York", "days": 3, "temp": -2.5, "metric": True, "opts": {"wind": [1, 2]},
                      "hours": [6, 12], "note": None, "extra": "007"}),  # a key the schema lacks stays text
        ("time", {})]
    # a value that does not parse as its type stays text; a string keeps inner newlines and blanks
    _, (call,) = qwen3_coder_calls("<tool_call><function=forecast><parameter=days>three</parameter>"
                                   "<parameter=city>\n two\nlines \n</parameter></function></tool_call>", fns)
    assert json.loads(call["function"]["arguments"]) == {"days": "three", "city": " two\nlines "}
    # the reply may end inside the last block, function or parameter; a bare <function= opens a call too
    assert named_args(qwen3_coder_calls("<tool_call>\n<function=forecast>\n<parameter=city>\nOslo", fns)[1]) == [
        ("forecast", {"city": "Oslo"})]
    assert named_args(qwen3_coder_calls("<function=time></function>", fns)[1]) == [("time", {})]
    for bad in ("<tool_call><function=rm></function></tool_call>", "<tool_call>{\"name\": \"time\"}</tool_call>",
                "<tool_call><function=time></function></tool_call> and then prose"):
        assert qwen3_coder_calls(bad, fns) == (bad, []), bad


def test_functiongemma_reads_its_escaped_argument_syntax():
    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "opts": {"type": "object", "properties": {"unit": {"type": "string"}, "hot": {"type": "boolean"}}}}}
    fns = {"forecast": {"name": "forecast", "parameters": schema}, "time": TIME["function"]}
    content, calls = functiongemma_calls(
        "Checking.<start_function_call>call:forecast{city:<escape>New York, NY<escape>,days:3,"
        "hours:[6,<escape>12<escape>],opts:{unit:<escape>C<escape>,hot:true}}<end_function_call>"
        "<start_function_call>call:time{}<end_function_call>",
        fns)
    assert content == "Checking." and named_args(calls) == [
        ("forecast", {"city": "New York, NY", "days": 3, "hours": [6, 12], "opts": {"unit": "C", "hot": True}}),
        ("time", {})]
    # escaped digits stay text where the schema says string; the end token may be missing at the end of the reply
    assert named_args(functiongemma_calls("<start_function_call>call:forecast{city:<escape>007<escape>}", fns)[1]) == [
        ("forecast", {"city": "007"})]
    assert named_args(functiongemma_calls("<start_function_call>call:forecast{city:Oslo}", fns)[1]) == [
        ("forecast", {"city": "Oslo"})]  # an unescaped word is text too
    for bad in ("<start_function_call>call:rm{}<end_function_call>", "<start_function_call>call:forecast{city:",
                "<start_function_call>call:forecast{city:<escape>Oslo}<end_function_call>",
                "<start_function_call>call:forecast{city:<escape>Oslo<escape>}<end_function_call> and prose",
                "<start_function_call>call:forecast(city='Oslo')<end_function_call>"):
        assert functiongemma_calls(bad, fns) == (bad, []), bad
    assert PARSERS["functiongemma"].sendable("Sure <start_func") == len("Sure ")


def test_new_parsers_stream_text_up_to_their_openers():
    auto = tool_plan([WEATHER], "auto", None)
    deltas = streamed(auto, ["Sure. [TOOL", '_CALLS]weather[ARGS]{"city": ', '"Oslo"}'], parser="mistral")
    assert [d for d, _ in deltas[:2]] == [{"content": "Sure. "}, {}]
    (call,), reason = deltas[2][0]["tool_calls"], deltas[2][1]
    assert reason == "tool_calls" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    deltas = streamed(auto, ["Hm <func", "tion=weather><parameter=city>Oslo</parameter></function>"],
                      parser="qwen3_coder")
    assert deltas[0] == ({"content": "Hm "}, None) and deltas[1][1] == "tool_calls"
    assert json.loads(deltas[1][0]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_what_a_streamed_reply_may_send_before_it_shows_a_call():
    hermes, llama, pythonic = PARSERS["hermes"], PARSERS["llama3_json"], PARSERS["pythonic"]
    assert hermes.sendable("Sure. <tool") == len("Sure. ") and hermes.sendable("a <tool_call>{") == 2
    assert hermes.sendable("plain text") == len("plain text") and hermes.sendable("x <") == 2
    for form, call in ((llama, '{"name"'), (llama, "<|python"), (pythonic, "[weather(")):
        assert form.sendable("") == 0 and form.sendable("  ") == 0 and form.sendable(call) == 0, call
    assert llama.sendable("The weather {") == len("The weather {")  # calls only at the start
    assert pythonic.sendable("Sure [x]") == len("Sure [x]")


def test_calls_at_the_start_stream_as_text_once_the_reply_shows_none():
    auto = tool_plan([WEATHER], "auto", None)
    deltas = streamed(auto, ["  ", "[weather(city=", "'Oslo')]"], parser="pythonic")
    assert deltas[0] == ({}, None) and deltas[1] == ({}, None)
    (call,), reason = deltas[2][0]["tool_calls"], deltas[2][1]
    assert reason == "tool_calls" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    deltas = streamed(auto, ["", "It is", " sunny."], parser="llama3_json")
    assert [d for d, _ in deltas] == [{}, {"content": "It is"}, {"content": " sunny."}]
    deltas = streamed(auto, ["[not a call", "]"], parser="pythonic")  # held, then text after all
    assert deltas == [({}, None), ({"content": "[not a call]"}, "stop")]


def whole(plan: ToolPlan, text: str, reason: str = "stop", parser: str | None = "hermes"):
    return ToolReply(plan, parser).message(text, reason)


def streamed(plan: ToolPlan, pieces: list[str], reason: str = "stop", parser: str | None = "hermes"):
    reply, deltas = ToolReply(plan, parser), []
    for i, piece in enumerate(pieces):
        deltas.append(reply.delta(piece, reason if i == len(pieces) - 1 else None))
    return deltas


def test_each_choice_shapes_the_whole_message():
    plans = {k: tool_plan([WEATHER, TIME], k, None) for k in ("none", "auto", "required")}
    call_text = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert whole(plans["none"], call_text) == ({"content": call_text}, "stop")
    refused("tool_choice", "--enable-auto-tool-choice", plans["auto"].check_served, None)  # no parser, no auto
    plans["auto"].check_served("hermes")
    plans["none"].check_served(None)
    plans["required"].check_served(None)  # forced calls need no parser: the output's form is known
    msg, reason = whole(plans["auto"], call_text)
    assert reason == "tool_calls" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert whole(plans["auto"], "Just text.") == ({"content": "Just text."}, "stop")
    two = call_text + '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    single = tool_plan([WEATHER, TIME], "auto", False)
    assert len(whole(plans["auto"], two)[0]["tool_calls"]) == 2 and len(whole(single, two)[0]["tool_calls"]) == 1
    msg, reason = whole(plans["required"], '[{"name": "time", "parameters": {}}]')
    assert reason == "tool_calls" and msg["tool_calls"][0]["function"] == {"name": "time", "arguments": "{}"}
    cut = '[{"name": "weather", "parameters": {"ci'
    assert whole(plans["required"], cut, "length") == ({"content": cut}, "length")  # cut short: no calls
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "weather"}}, None)
    msg, reason = whole(named, '{"city": "Rome"}')
    assert reason == "stop"  # as OpenAI answers a forced call
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "weather",
                                                                           "arguments": '{"city": "Rome"}'}


def test_a_named_call_streams_its_arguments():
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "weather"}}, None)
    deltas = streamed(named, ['{"ci', '', 'ty": "Rome"}', ''])
    first = deltas[0][0]["tool_calls"][0]
    assert first["function"]["name"] == "weather" and first["id"].startswith("chatcmpl-tool-")
    assert deltas[1] == ({}, None) and deltas[-1] == ({}, "stop")
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d, _ in deltas if d)
    assert json.loads(args) == {"city": "Rome"}
    assert all("id" not in d["tool_calls"][0] for d, _ in deltas[1:] if d)


def test_auto_streams_text_and_holds_back_what_may_start_a_call():
    auto = tool_plan([WEATHER], "auto", None)
    deltas = streamed(auto, ["Sure. <tool", "_call>{\"name\": \"weather\", ", '"arguments": {"city": "Oslo"}}',
                             "</tool_call>"])
    assert deltas[0] == ({"content": "Sure. "}, None)  # "<tool" held: it may open a call
    assert deltas[1] == ({}, None) and deltas[2] == ({}, None)
    last, reason = deltas[3]
    assert reason == "tool_calls" and last["tool_calls"][0]["index"] == 0
    assert json.loads(last["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    # a held piece that turns out not to open a call goes out as text
    deltas = streamed(auto, ["a <tool", "s list", ""])
    assert "".join(d.get("content", "") for d, _ in deltas) == "a <tools list" and deltas[-1][1] == "stop"
    # an unparsable call at the end: everything comes back as text
    deltas = streamed(auto, ["x<tool_call>{bad", "", ""])
    assert "".join(d.get("content", "") for d, _ in deltas) == "x<tool_call>{bad"
    assert deltas[-1][1] == "stop"


def test_required_streams_the_calls_once_the_array_is_complete():
    required = tool_plan([WEATHER, TIME], "required", None)
    deltas = streamed(required, ['[{"name": "time", ', '"parameters": {}}, {"name": "weather", "parameters": ',
                                 '{"city": "Lima"}}]'])
    assert deltas[0] == ({}, None) and deltas[1] == ({}, None)
    calls, reason = deltas[2]
    assert reason == "tool_calls" and [c["index"] for c in calls["tool_calls"]] == [0, 1]
    assert [c["function"]["name"] for c in calls["tool_calls"]] == ["time", "weather"]

"""Structured outputs on the embedded model: every output matches its JSON schema, regex, choice list or grammar,
greedy or sampled, n > 1 and under preemption; bad constraints are refused by name and leave nothing behind."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from kvpage.engine.llm import LLM
from kvpage.errors import InvalidRequestError
from kvpage.sampling_params import SamplingParams
from kvpage.sampling_params import StructuredOutputsParams as SO

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Describe a person called Ada who is 36, as JSON."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="128MiB", max_model_len=512, dtype="float32")


def drained(llm: LLM) -> bool:
    kv = llm.engine.kv
    kv.check_invariants()
    return kv.num_free_blocks == kv.num_blocks and not llm.engine.has_unfinished_requests()


def test_json_schema_greedy_and_sampled(llm):
    greedy = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=48, structured_outputs=SO(json=PERSON)),
                      use_tqdm=False)[0].outputs[0]
    person = json.loads(greedy.text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 12
    assert greedy.finish_reason == "stop"
    sampled = llm.chat(CHAT, SamplingParams(max_tokens=48, n=4, seed=3, structured_outputs=SO(json=json.dumps(PERSON))),
                       use_tqdm=False)[0].outputs
    for out in sampled:
        assert out.finish_reason == "stop", out.text
        assert set(json.loads(out.text)) == {"name", "age"}
    free = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert free.text != greedy.text  # the constraint did change what the model wrote
    assert drained(llm)


def test_json_object_regex_choice_and_grammar(llm):
    prompts = ["Answer yes or no: is the sky blue?", "Call me at", "Give a JSON object with a name and an age:",
               "Code:"]
    forms = [SO(choice=["yes", "no", "maybe"]), SO(regex=r"\(\d{3}\) \d{3}-\d{4}"), SO(json_object=True),
             SO(grammar='root ::= "KV-" [0-9] [0-9] [0-9]')]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=40, seed=i, structured_outputs=f,
                                                 temperature=0 if f.json_object else 1)  # (a sampled object rambles)
                                  for i, f in enumerate(forms)], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", texts[1])
    assert isinstance(json.loads(texts[2]), dict)
    assert re.fullmatch(r"KV-\d{3}", texts[3])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    # the free-text requests of the same batch are untouched
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(prompts[1], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([prompts[1], prompts[0]], [plain, SamplingParams(temperature=0, max_tokens=4,
                                                                         structured_outputs=forms[0])],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert drained(llm)


def test_constraints_survive_preemption():
    tight = LLM(kv_cache_memory=16 * 30 * 8 * 3 * 128 * 4, block_size=8, max_model_len=96, dtype="float32",
                preemption_mode="recompute")
    form = r"([a-z]{2,6} ){11}[a-z]{2,6}\."
    params = SamplingParams(max_tokens=80, seed=1, structured_outputs=SO(regex=form))
    outs = tight.generate([f"Say twelve words about item {i}:" for i in range(8)], params, use_tqdm=False)
    assert tight.engine.stats()["preemptions"] > 0
    for o in outs:
        assert re.fullmatch(form, o.outputs[0].text), o.outputs[0].text
    assert drained(tight)


@pytest.mark.parametrize(("form", "words"), [
    (dict(regex="(unclosed"), "structured_outputs"),
    (dict(json='{"type": "object", '), "structured_outputs"),
    (dict(grammar="start: undefined_rule"), "structured_outputs"),
])
def test_bad_constraints_are_refused_by_name(llm, form, words):
    with pytest.raises(InvalidRequestError, match=words):
        llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs=SO(**form)))
    assert drained(llm)


def test_params_take_exactly_one_form():
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])


def test_masked_rows_draw_in_the_logits_pass_as_from_the_logits(llm, monkeypatch):
    """Rows that only limit which tokens may come (structured outputs, allowed ids, min_tokens, bad words) draw
    inside the logits pass with a bit mask, and give the same tokens, seed for seed, as drawn from the step's
    logits; penalties still take the logits."""
    import kvpage.worker.worker as worker_mod

    prompts = ["Give a JSON object with a name and an age:", "Call me at", "Pick a colour:", "Once upon a time",
               "The number is", "Write a word:"]
    params = [SamplingParams(max_tokens=24, seed=1, structured_outputs=SO(json=PERSON)),
              SamplingParams(max_tokens=16, temperature=0, structured_outputs=SO(regex=r"\(\d{3}\) \d{3}-\d{4}")),
              SamplingParams(max_tokens=6, seed=2, top_p=0.9, structured_outputs=SO(choice=["red", "green", "blue"])),
              SamplingParams(max_tokens=12, seed=3, min_tokens=10, bad_words=["the", "a"]),
              SamplingParams(max_tokens=8, seed=4, top_k=20, allowed_token_ids=[*range(28, 40), 2]),
              SamplingParams(max_tokens=10, seed=5)]
    plan, fused = worker_mod.logits_pass_draws, []

    def counting(reqs, vocab):
        out = plan(reqs, vocab)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(worker_mod, "logits_pass_draws", counting)
    in_pass = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused and all(fused)
    fused.clear()
    penalized = SamplingParams(max_tokens=4, presence_penalty=0.5, ignore_eos=True)
    llm.generate(prompts[:2], [params[0], penalized], use_tqdm=False)
    assert fused and not any(fused[:2])  # a penalty changes values: the step takes the logits
    monkeypatch.setattr(worker_mod, "logits_pass_draws", lambda reqs, vocab: None)
    from_logits = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert in_pass == from_logits
    assert all(28 <= t < 40 or t == 2 for t in in_pass[4])
    assert drained(llm)


def test_chat_hands_tools_to_the_template(llm):
    template = "{% for t in tools %}{{ t.function.name }}: {{ t | tojson }}\n{% endfor %}{{ messages[0].content }}"
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    out = llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template, tools=[tool])[0]
    # keys in the given order, as transformers' tojson writes them (Jinja's own would sort them)
    assert out.prompt == ('weather: {"type": "function", "function": {"name": "weather", "parameters": '
                          '{"type": "object"}}}\n' + CHAT[0]["content"])
    assert drained(llm)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
TAG = {"structures": [{"begin": "<function=weather>", "schema": CITY, "end": "</function>"}],
       "triggers": ["<function="]}


def test_a_structural_tag_holds_what_follows_its_trigger(llm):
    tk = llm.engine.tokenizer

    def takes(text: str) -> bool:
        matcher = llm.engine.grammars.compile(SO(structural_tag=TAG)).deep_copy()
        ids = tk.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids)

    assert takes('Let me check. <function=weather>{"city":"Oslo"}</function> Done.')
    assert takes("No call at all, just text.")
    assert not takes('<function=weather>{"town":"Oslo"}')  # the schema holds once the trigger is written
    assert not takes("<function=rain>{}")  # no structure begins so
    # the text form (as vLLM's structured_outputs.structural_tag sends it) is the same constraint
    out = llm.generate("The weather tool is called like this: <function=weather>",
                       SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(structural_tag=json.dumps(
                           TAG))), use_tqdm=False)[0].outputs[0]
    assert out.token_ids and drained(llm)
    for bad, words in (({"structures": TAG["structures"], "triggers": ["<tool="]}, "none of the triggers"),
                       ({"structures": [], "triggers": ["<f"]}, "non-empty list"),
                       ({"format": {"type": "triggered_tags"}}, "triggers must be a non-empty list")):
        with pytest.raises(ValueError, match=words):
            llm.engine.grammars.compile(SO(structural_tag=bad))


OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
FN = {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": OBJ}, "end": "</f>"}


def _format_reader(llm, fmt: dict):
    """reads(text) -> (every token taken, the output may end there) under xgrammar's format form."""
    tk = llm.engine.tokenizer

    def reads(text: str) -> tuple[bool, bool]:
        matcher = llm.engine.grammars.compile(SO(structural_tag={"type": "structural_tag", "format": fmt})).deep_copy()
        ids = tk.encode(text, add_special_tokens=False)
        took = matcher.try_consume_tokens(ids) == len(ids)
        return took, took and matcher.is_accepting()
    return reads


def test_the_format_form_tags_sequences_and_free_text(llm):
    think = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": ["</think>", "</t>"]},
        {"type": "const_string", "value": "\n"}, {"type": "json_schema", "json_schema": OBJ}]}
    reads = _format_reader(llm, think)
    assert reads('<think>some thought, <b>tags</b> too</think>\n{"x": 3}') == (True, True)
    assert reads('<think>short</t>\n{"x": 3}') == (True, True)  # either end closes it
    assert reads("<think>still thinking") == (True, False)  # may go on, may not end here
    assert not reads('<think>x</think>\nplain text')[0]
    shaped = _format_reader(llm, {"type": "sequence", "elements": [
        {"type": "regex", "pattern": "[A-Z]{3}"},
        {"type": "repeat", "min": 1, "max": 2, "content": {"type": "const_string", "value": "!"}},
        {"type": "optional", "content": {"type": "or", "elements": [{"type": "const_string", "value": " yes"},
                                                                     {"type": "const_string", "value": " no"}]}}]})
    assert shaped("ABC!") == (True, True) and shaped("ABC!! no") == (True, True)
    assert not shaped("ABC!!!")[0] and not shaped("AB!")[0] and not shaped("ABC! maybe")[0]
    assert shaped("ABC") == (True, False)  # one "!" at least


def test_the_format_form_triggered_tags_and_separated_tags(llm):
    def triggered(**flags):
        return _format_reader(llm, {"type": "triggered_tags", "triggers": ["<f="], "tags": [FN], **flags})
    call = '<f=a>{"x": 1}</f>'
    free = triggered()
    assert free(f"Let me call. {call} Done.") == (True, True) and free("No call.") == (True, True)
    assert not free('Text <f=a>{"y": 1}')[0]  # once the trigger is written, the tag and its schema hold
    assert not free("Text <f=b>")[0]
    first = triggered(at_least_one=True)
    assert not first("Text before")[0] and first(f"{call} then text") == (True, True)
    once = triggered(stop_after_first=True)
    assert once(f"Text {call}") == (True, True) and not once(f"Text {call} more")[0]
    only = triggered(at_least_one=True, stop_after_first=True)
    assert only(call) == (True, True) and not only(f" {call}")[0]
    listed = _format_reader(llm, {"type": "tags_with_separator", "tags": [FN], "separator": ",", "at_least_one": True})
    assert listed(f"{call},{call}") == (True, True) and listed(call) == (True, True)
    assert listed("") == (True, False) and not listed(f"{call} x")[0]
    out = llm.generate("A call: ", SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(
        structural_tag={"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="],
                                                              "tags": [FN], "at_least_one": True,
                                                              "stop_after_first": True}})),
                       use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("<f=a>{") and drained(llm)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "token", "token": 5}, "token-level"),
    ({"type": "dispatch", "rules": []}, "dispatch"),
    ({"type": "grammar", "grammar": "root ::= \"a\""}, "structured_outputs.grammar"),
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "x"}]},
     "any_text must end"),
    ({"type": "tag", "begin": "<a>", "content": {"type": "any_text", "excludes": ["x"]}, "end": "</a>"}, "excludes"),
    ({"type": "sequence", "elements": [{"type": "triggered_tags", "triggers": ["<f="], "tags": [FN]},
                                       {"type": "const_string", "value": "x"}]}, "must come last"),
    ({"type": "json_schema", "json_schema": OBJ, "style": "qwen_xml"}, "style 'json'"),
    ({"type": "repeat", "min": 1, "max": 1000, "content": {"type": "const_string", "value": "x"}}, "repeat needs"),
    ({"type": "triggered_tags", "triggers": ["<f", "<f="], "tags": [FN]}, "exactly one trigger"),
    ({"type": "tag", "begin": {"type": "token", "token": 3}, "content": {"type": "any_text"}, "end": "x"},
     "token begins"),
    ({"type": "wizard"}, "unknown format type"),
])
def test_the_format_form_refuses_what_it_cannot_hold_by_name(llm, fmt, words):
    with pytest.raises(ValueError, match=words):
        llm.engine.grammars.compile(SO(structural_tag={"type": "structural_tag", "format": fmt}))


def test_the_format_form_reads_every_case_as_xgrammar_does(llm):
    """benchmarks/structural_tags.py's 49 texts under its formats: whether the whole text is taken and whether the
    output may end there, as xgrammar 0.2.8 (vLLM 0.32's grammar engine) decided each, independently of kvpage."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "structural_tags.py"
    spec = importlib.util.spec_from_file_location("structural_tags", path)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    for (fmt, text), expected in zip(cases.CASES, cases.XGRAMMAR, strict=True):
        assert list(_format_reader(llm, fmt)(text)) == expected, (fmt["type"], text)

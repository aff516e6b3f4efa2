"""Structured outputs on the embedded model: every output matches its JSON schema, regex, choice list or grammar,
greedy or sampled, n > 1 and under preemption; bad constraints are refused by name and leave nothing behind."""

from __future__ import annotations

import json
import re

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
                       ({"format": {"type": "triggered_tags"}}, "'format' form")):
        with pytest.raises(ValueError, match=words):
            llm.engine.grammars.compile(SO(structural_tag=bad))

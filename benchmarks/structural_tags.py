"""Structural tags in xgrammar's format form, read by kvpage (engine/structural_format.py, on llguidance) and by
xgrammar itself (the grammar engine vLLM 0.32 uses), text by text: does each take the whole text, and may the
output end there? The cases cover every format kvpage takes (tags with one or several ends, free text inside a
tag and at the end, triggered tags with each flag, separated tags, sequences, alternatives and repeats).

    python benchmarks/structural_tags.py [--xgrammar-python /root/peers/vllm/bin/python]

Without --xgrammar-python it compares against xgrammar 0.2.8's verdicts recorded below (which the tests hold
kvpage to, tests/engine/test_structured.py); with it, xgrammar runs in that interpreter (with the Hugging Face
SmolLM2 tokenizer at --tokenizer) and the recorded verdicts are checked too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
FN = {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": OBJ}, "end": "</f>"}
FN2 = {"type": "tag", "begin": "<f=b>", "content": {"type": "json_schema", "json_schema": {"type": "object"}},
       "end": "</f>"}
call = '<f=a>{"x": 1}</f>'


def tt(**flags: bool) -> dict:
    return {"type": "triggered_tags", "triggers": ["<f="], "tags": [FN, FN2], **flags}


think = {"type": "sequence", "elements": [
    {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": ["</think>", "</t>"]},
    {"type": "const_string", "value": "\n"}, {"type": "json_schema", "json_schema": OBJ}]}
shaped = {"type": "sequence", "elements": [
    {"type": "regex", "pattern": "[A-Z]{3}"},
    {"type": "repeat", "min": 1, "max": 2, "content": {"type": "const_string", "value": "!"}},
    {"type": "optional", "content": {"type": "or", "elements": [{"type": "const_string", "value": " yes"},
                                                                 {"type": "const_string", "value": " no"}]}}]}
sep = {"type": "tags_with_separator", "tags": [FN, FN2], "separator": ","}
star = {"type": "sequence", "elements": [{"type": "star", "content": {"type": "const_string", "value": "ab"}},
                                          {"type": "plus", "content": {"type": "regex", "pattern": "[0-9]"}}]}
tag_or = {"type": "tag", "begin": "<a>", "content": {"type": "or", "elements": [
    {"type": "const_string", "value": "x"}, {"type": "any_text"}]}, "end": "</a>"}
slash = {"type": "regex", "pattern": "[0-9]+/[0-9]+"}  # a slash in a pattern (Lark's regex delimiter)
escaped = {"type": "regex", "pattern": "a\\/b"}
tail_text = {"type": "sequence", "elements": [{"type": "const_string", "value": "Note: "}, {"type": "any_text"}]}
CASES = [
    (think, '<think>some thought, <b>tags</b> too</think>\n{"x": 3}'), (think, '<think>short</t>\n{"x": 3}'),
    (think, "<think>still thinking"), (think, '<think>x</think>\nplain'), (think, '<think>a</think></think>\n{"x": 1}'),
    (shaped, "ABC!"), (shaped, "ABC!! no"), (shaped, "ABC!!!"), (shaped, "AB!"), (shaped, "ABC! maybe"),
    (shaped, "ABC"),
    (tt(), f"Let me call. {call} Done."), (tt(), "No call."), (tt(), 'Text <f=a>{"y": 1}'), (tt(), "Text <f=c>"),
    (tt(), f"{call}{call}"), (tt(), 'x <f=b>{"any": [1]}</f> y'), (tt(), ""),
    (tt(at_least_one=True), "Text before"), (tt(at_least_one=True), f"{call} then text"), (tt(at_least_one=True), ""),
    (tt(stop_after_first=True), f"Text {call}"), (tt(stop_after_first=True), f"Text {call} more"),
    (tt(stop_after_first=True), "just text"),
    (tt(at_least_one=True, stop_after_first=True), call), (tt(at_least_one=True, stop_after_first=True), f" {call}"),
    (tt(at_least_one=True, stop_after_first=True), f"{call}x"),
    (sep, f"{call},{call}"), (sep, call), (sep, ""), (sep, f"{call} x"), (sep, f"{call},"),
    ({**sep, "at_least_one": True}, ""), ({**sep, "stop_after_first": True}, f"{call},{call}"),
    (star, "abab12"), (star, "1"), (star, "ab"), (star, "aba1"),
    (tag_or, "<a>x</a>"), (tag_or, "<a>anything here</a>"), (tag_or, "<a>x"), (tag_or, "<a>y</a>z"),
    (tail_text, "Note: whatever <f=a> comes"), (tail_text, "Note"), (tail_text, "Nope"),
    (slash, "12/34"), (slash, "12-34"), (escaped, "a/b"), (escaped, "a\\b"),
]

# xgrammar 0.2.8 (vLLM 0.32.0's), 2026-12-06: [takes the whole text, may end there] per case
XGRAMMAR = [[c[0] == "T", c[1] == "T"] for c in (  # T/F: takes the text, may end there
    'TT', 'TT', 'TF', 'FF', 'FF', 'TT', 'TT', 'FF', 'FF', 'FF', 'TF', 'TT', 'TT', 'FF', 'FF', 'TT', 'TT', 'TT',
    'FF', 'TT', 'TF', 'TT', 'FF', 'TT', 'TT', 'FF', 'FF', 'TT', 'TT', 'TT', 'FF', 'TF', 'TF', 'FF', 'TT', 'TT',
    'TF', 'FF', 'TT', 'TT', 'TF', 'FF', 'TT', 'TF', 'FF', 'TT', 'FF', 'TT', 'FF')]

_XGRAMMAR_SCRIPT = """
import json, sys
import xgrammar as xgr
from transformers import AutoTokenizer
cases = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
out = []
for fmt, text in cases:
    m = xgr.GrammarMatcher(comp.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt})))
    took = m.accept_string(text)
    out.append([bool(took), bool(took and m.accept_token(tok.eos_token_id))])
print(json.dumps(out))
"""


def kvpage_verdicts() -> list[list[bool]]:
    from kvpage.engine.llm import LLM
    from kvpage.sampling_params import StructuredOutputsParams

    llm = LLM(kv_cache_memory="64MiB", max_model_len=256)
    tk, out = llm.engine.tokenizer, []
    for fmt, text in CASES:
        spec = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})
        matcher = llm.engine.grammars.compile(spec).deep_copy()
        ids = tk.encode(text, add_special_tokens=False)
        took = matcher.try_consume_tokens(ids) == len(ids)
        out.append([took, bool(took and matcher.is_accepting())])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xgrammar-python", help="a Python with xgrammar and transformers (vLLM's venv)")
    ap.add_argument("--tokenizer", default="/root/peers/smollm2-hf", help="the Hugging Face tokenizer xgrammar uses")
    args = ap.parse_args()
    reference = XGRAMMAR
    if args.xgrammar_python:
        run = subprocess.run([args.xgrammar_python, "-c", _XGRAMMAR_SCRIPT, args.tokenizer], input=json.dumps(CASES),
                             capture_output=True, text=True, check=True)
        reference = json.loads(run.stdout.strip().splitlines()[-1])
        if reference != XGRAMMAR:
            print("xgrammar's verdicts differ from those recorded here (another xgrammar version?)")
    ours = kvpage_verdicts()
    differ = 0
    for (fmt, text), ref, got in zip(CASES, reference, ours, strict=True):
        if ref != got:
            differ += 1
            print(f"differs: {fmt['type']} {text!r}: xgrammar {ref}, kvpage {got}")
    print(f"{len(CASES)} cases, {differ} differ (xgrammar {'run now' if args.xgrammar_python else 'as recorded'})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

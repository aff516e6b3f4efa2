"""Structured outputs: a request's schema, regex, choice list or grammar compiled once (llguidance), and per
sequence a matcher that says which tokens may come next and follows the tokens drawn.

The matcher works on the model's own vocabulary (its tokenizer's JSON, every token's bytes), so a constraint
holds whatever way the model splits the text into tokens. Compiling a JSON schema or a grammar takes
milliseconds to a second for large ones: each distinct constraint is compiled once per engine (an LRU of
unstarted matchers), and each sequence starts from a copy.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvpage.engine.structural_format import format_grammar
from kvpage.sampling_params import StructuredOutputsParams

GRAMMAR_CACHE = 64  # distinct constraints kept compiled


def _choice_grammar(choices: Sequence[str]) -> str:
    """A Lark grammar whose language is exactly the choices (each a JSON-escaped string literal)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + "\n"


def structural_tag_grammar(spec: str | dict) -> str:
    """A Lark grammar for a structural tag. vLLM's first form, {"structures": [{"begin", "schema", "end"}],
    "triggers"}: free text until a trigger, then one of the structures whose begin starts with it, its JSON, its
    end, and free text again (llguidance's lazy lexemes); xgrammar's "format" form: structural_format.py."""
    from llguidance import StructTag

    tag = json.loads(spec) if isinstance(spec, str) else spec
    if isinstance(tag, dict) and "format" in tag:  # xgrammar's newer form: a tree of formats
        return format_grammar(tag)
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be {'structures': [{'begin', 'schema', 'end'}], 'triggers': [...]} "
                         "or {'type': 'structural_tag', 'format': {...}}")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag structures must be a non-empty list")
    tags = []
    for i, st in enumerate(structures):
        begin, end, schema = (st.get(k) for k in ("begin", "end", "schema")) if isinstance(st, dict) else (None,) * 3
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict | None):
            raise ValueError(f"structural_tag structures[{i}] needs begin and end strings and a schema object")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structural_tag structures[{i}]: begin {begin!r} starts with none of the triggers")
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=schema or {"type": "object"}, end=end))
    return StructTag.to_grammar(tags, assume_special=False)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for one constraint (not yet checked: compiling it does that)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark(_choice_grammar(spec.choice))
    if spec.structural_tag is not None:
        return LLMatcher.grammar_from_lark(structural_tag_grammar(spec.structural_tag))
    return LLMatcher.grammar_from_lark(any_to_lark(spec.grammar or ""))


class Guide:
    """One sequence's matcher: the allowed next tokens as a bit mask, and the tokens drawn fed back in."""

    def __init__(self, matcher: Any, vocab_size: int, executor: Any) -> None:
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32  # int32 words of one mask
        self.executor = executor  # llguidance's thread pool, shared by the engine's guides

    def next_masks(self, guides: Sequence[Guide]) -> np.ndarray:
        """[len(guides), words] int32, row r bit j of word i set when token 32 i + j may come next for guide r
        (guides of this kind), computed in parallel by llguidance's threads: 64 sequences' masks in ~0.1 ms
        where one after another took ~5 ms (AMX Xeon)."""
        out = np.zeros((len(guides), self.words), dtype=np.int32)
        self.executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(guides)], out.ctypes.data,
                                            self.words * 4, len(guides))
        return out

    def advance(self, token_id: int) -> bool:
        """Follow a drawn token; True when the match is complete and takes nothing more (the sequence ends).
        A token the constraint does not allow raises, naming the reason."""
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"structured output: token {token_id} breaks the constraint "
                             f"({self.matcher.get_error() or 'not allowed here'})")
        return self.matcher.is_stopped()


class GrammarCompiler:
    """The engine's structured-output compiler: the tokenizer's llguidance view (built on first use) and the
    compiled constraints, shared by the server's worker threads and the engine's."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer_json = tokenizer_json  # the tokenizer.json text, asked for once, on first use
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._tokenizer: Any = None
        self._executor: Any = None  # llguidance's thread pool for the masks (one thread per core), made on first use
        self._matchers: OrderedDict[str, Any] = OrderedDict()  # constraint key -> its matcher, unstarted
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                try:
                    from llguidance import LLTokenizer
                except ImportError as e:
                    raise ValueError("structured outputs need the llguidance package (pip install llguidance)") from e
                self._tokenizer = LLTokenizer(self.tokenizer_json(), n_vocab=self.vocab_size, eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """A matcher at the start of ``spec``'s constraint, compiled once and kept (every sequence starts from a
        copy of it), or ValueError saying what is wrong with the constraint. The server calls this on a worker
        thread before it submits a request, so the engine's own call finds it compiled."""
        key = spec.key
        with self._lock:
            if key in self._matchers:
                self._matchers.move_to_end(key)
                return self._matchers[key]
        from llguidance import LLMatcher

        tokenizer = self.tokenizer
        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as e:  # a schema that is not JSON, say
            raise ValueError(f"structured_outputs: {e}") from None
        matcher = LLMatcher(tokenizer, grammar, log_level=0)  # (the GIL is let go while it compiles)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error().splitlines()[0][:500]}")
        with self._lock:
            self._matchers[key] = matcher
            while len(self._matchers) > GRAMMAR_CACHE:
                self._matchers.popitem(last=False)
        return matcher

    def guide(self, spec: StructuredOutputsParams) -> Guide:
        """A fresh matcher at the start of the constraint, for one sequence."""
        matcher = self.compile(spec).deep_copy()
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(os.cpu_count() or 1)
        return Guide(matcher, self.vocab_size, self._executor)

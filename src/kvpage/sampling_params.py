"""Per-request generation settings, with vLLM's names and defaults; invalid values raise naming the range."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

OutputKind = Literal["cumulative", "delta", "final_only"]
MAX_LOGPROBS = 20
# A temperature below this is greedy: dividing logits by it would overflow float32 (vLLM's threshold too).
SAMPLING_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_BEAM_WIDTH = 64  # each beam step ranks beam_width x 2 beam_width candidates in Python
MAX_LENGTH_PENALTY = 10.0  # a score is divided by length ** length_penalty: keep that a finite float
MAX_BAD_WORDS = 256  # each is tokenized when the request is added and matched at every step


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names; exactly one): a JSON schema (``json``, a dict or its text), any
    JSON object (``json_object``), a regular expression, one of a list of strings (``choice``), a grammar
    (Lark, as llguidance reads it, or GBNF as llama.cpp writes it), or a structural tag (free text in which each
    trigger opens a tagged segment held to its JSON schema: {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}, a dict or its text, vLLM's). Each step masks every token the match cannot take; the
    sequence ends when the match is complete and can take nothing more."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            choice = [self.choice] if isinstance(self.choice, str) else list(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"structured_outputs choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string, got {value!r}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs json must be a JSON schema (an object or its text), got "
                             f"{type(self.json).__name__}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, str | dict):
            raise ValueError(f"structured_outputs structural_tag must be an object (or its text), got "
                             f"{type(self.structural_tag).__name__}")
        kinds = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, structural_tag "
                             f"and json_object, got {kinds or 'none'}")

    @cached_property
    def key(self) -> str:
        """A text that identifies the constraint (compiled grammars are cached under it; asked for by the server,
        the engine and every sequence's matcher, so written once)."""
        return json.dumps({"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                           "json_object": self.json_object, "structural_tag": self.structural_tag}, sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    # top-N logprobs per prompt token (each token's own always included; the first token has none): what
    # scoring harnesses (lm-eval's loglikelihood) read. Such a request skips the prefix cache's hits, as its
    # hidden states are needed for every prompt position.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: OutputKind = "cumulative"
    logit_bias: dict[int, float] | None = None  # added to the token's logit before any filter
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    # words the output must not contain: each word's last token is masked wherever the output so far ends with
    # the rest of the word's tokens (the engine tokenizes them when the request is added: bad_words_token_ids)
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # output constrained to a schema / regex / grammar
    stop_list: list[str] = field(init=False, repr=False)
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(what)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            need(isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
                 f"{name} must be a finite number, got {value!r}")
        need(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1, 0 (all) or >= 1, got {self.top_k!r}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        need(self.output_kind in ("cumulative", "delta", "final_only"),
             f"output_kind must be cumulative, delta or final_only, got {self.output_kind!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        need(all(isinstance(s, str) and s for s in stops), f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_list = stops
        ids = list(self.stop_token_ids or [])
        need(all(isinstance(t, int) and t >= 0 for t in ids), f"stop_token_ids must be token ids >= 0, got {ids!r}")
        self.stop_token_ids = ids
        if self.logit_bias is not None:
            bias = dict(self.logit_bias)
            need(all(isinstance(t, int) and t >= 0 for t in bias),
                 f"logit_bias keys must be token ids >= 0, got {sorted(map(repr, bias))[:5]}")
            need(all(isinstance(v, int | float) and math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS
                     for v in bias.values()),
                 f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            self.logit_bias = {t: float(v) for t, v in bias.items()} or None
        if self.allowed_token_ids is not None:
            allowed = list(self.allowed_token_ids)
            need(bool(allowed) and all(isinstance(t, int) and t >= 0 for t in allowed),
                 f"allowed_token_ids must be a non-empty list of token ids >= 0, got {allowed[:5]!r}")
            self.allowed_token_ids = allowed
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            need(all(isinstance(w, str) and w.strip() for w in words),
                 f"bad_words must be a list of words with something besides spaces, got {self.bad_words!r}")
            self.bad_words = list(dict.fromkeys(words)) or None
            need(len(self.bad_words or ()) <= MAX_BAD_WORDS,
                 f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(self.bad_words or ())}")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    def tokenize_bad_words(self, encode: Callable[[str], list[int]]) -> None:
        """Each bad word's token ids, as it would appear at the output's start and after a space (both, when they
        differ): what ``banned_ids`` matches against the output."""
        seqs: list[list[int]] = []
        for word in self.bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(encode(text))
                if not ids:
                    raise ValueError(f"bad_words entry {word!r} tokenizes to nothing")
                if ids not in seqs:
                    seqs.append(ids)
        self.bad_words_token_ids = seqs

    def banned_ids(self, token_ids: list[int], num_output: int) -> list[int]:
        """The tokens that would complete a bad word now, given a sequence's ``token_ids`` of which the last
        ``num_output`` are output (a bad word's earlier tokens are matched within the output only)."""
        out = []
        for ids in self.bad_words_token_ids:
            head = len(ids) - 1
            if head <= num_output and (head == 0 or token_ids[len(token_ids) - head :] == ids[:head]):
                out.append(ids[-1])
        return out

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one too small to divide by: both mean the most likely token."""
        return self.temperature < SAMPLING_EPS

    @property
    def token_ids_in_params(self) -> list[int]:
        """Every token id the settings name (checked against the vocabulary when the request is added)."""
        return [*(self.stop_token_ids or []), *(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    @property
    def shapes_logits(self) -> bool:
        """Anything besides temperature and the filters that changes the logits before a draw."""
        return (self.uses_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.structured_outputs is not None)

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass
class BeamSearchParams:
    """Beam search settings, with vLLM's names (``LLM.beam_search``) plus transformers' ``early_stopping``.

    ``temperature`` shapes the distribution the candidates' log-probabilities come from (0 = the model's own,
    as 1). ``ignore_eos``: EOS is an ordinary token (it ends nothing); ``min_tokens`` keeps EOS and the stop
    ids out of the candidates until that many tokens exist. ``n``: how many of the best finished beams come
    back (default beam_width)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False  # transformers': False (heuristic), True, or "never"
    n: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(what)

        need(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool) and self.beam_width >= 1,
             f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        need(self.beam_width <= MAX_BEAM_WIDTH, f"beam_width must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}")
        n = self.beam_width if self.n is None else self.n
        need(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= self.beam_width,
             f"n must be an integer in [1, beam_width={self.beam_width}], got {self.n!r}")
        self.n = n
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            need(isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
                 f"{name} must be a finite number, got {value!r}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(abs(self.length_penalty) <= MAX_LENGTH_PENALTY,
             f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got {self.length_penalty}")
        need(self.early_stopping in (True, False, "never"),
             f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        # the length and stop checks are SamplingParams' own
        self.sampling_params()

    def sampling_params(self) -> SamplingParams:
        """The per-sequence settings every beam of the request runs with (final output only)."""
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, min_tokens=self.min_tokens,
                              ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              output_kind="final_only")

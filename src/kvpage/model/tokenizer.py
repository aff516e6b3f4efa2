"""Tokenizer from GGUF metadata (byte-level BPE vocab + merges) or a Hugging Face tokenizer.json,
chat templates, and incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvpage.model.chat_template import render_chat_template

logger = logging.getLogger(__name__)

# Pre-tokenizer split rules by GGUF ``tokenizer.ggml.pre`` name (the same families llama.cpp knows).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TYPES = (3, 4)
_CONTROL, _USER_DEFINED = 3, 4
# Architectures whose SentencePiece vocabulary is ranked by its order in the file, not by its scores, and
# spells runs of spaces as real spaces (Gemma's GGUF files).
_RANKED_BY_POSITION = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"  # SentencePiece's visible space


def _spm_merges(tokens: Sequence[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary's merges, which its GGUF file does not list: every split of a token into
    two tokens of the vocabulary, best-ranked token first, and for one token the longer left part first."""
    vocab = set(tokens)
    found: list[tuple[float, int, str, str]] = []
    for token, score in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((score, cut, left, right))
    found.sort(key=lambda m: (m[0], m[1], len(m[3])), reverse=True)
    return [(left, right) for _, _, left, right in found]


def _sentencepiece_bpe(fields: dict[str, Any], architecture: str | None) -> tuple[Tokenizer, set[int]]:
    """A SentencePiece BPE tokenizer (GGUF ``tokenizer.ggml.model`` = "llama") with byte fallback: spaces
    become \u2581 before merging, unknown characters their <0xNN> bytes. Returns it with its special ids."""
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    original = list(tokens)
    if architecture in _RANKED_BY_POSITION:
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: float(-i) for i, t in enumerate(tokens)}
    else:
        scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        rank = {t: float(sc) for t, sc in zip(tokens, scores, strict=True)}
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, rank), fuse_unk=True, unk_token=unk,
                              byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", _SPACE)
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tk.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    control = [i for i, t in enumerate(types) if t == _CONTROL]
    tk.add_special_tokens([AddedToken(original[i], special=True, normalized=False) for i in control])
    # user-defined tokens (e.g. runs of newlines) are matched whole in the text, as llama.cpp does
    user = [original[i] for i, t in enumerate(types) if t == _USER_DEFINED and original[i] in vocab]
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tk, set(control)


def _byte_level_pre(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):  # GPT-2 rules with every digit on its own
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("unknown GGUF pre-tokenizer %r: using GPT-2 byte-level rules", pre)
    return gpt2


class KVTokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with the ids and template a server needs."""

    def __init__(self, tokenizer: Tokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 add_bos_token: bool, chat_template: str | None, special_ids: set[int]) -> None:
        self._tk = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.special_ids = frozenset(special_ids)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tk.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def to_json(self) -> str:
        """The tokenizer in Hugging Face's tokenizer.json form (what structured outputs read the vocabulary from)."""
        return self._tk.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **extra: Any) -> str:
        """The conversation as prompt text, through ``chat_template`` if given, else the model's own."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template: send a plain prompt instead of messages, or give "
                             "one (--chat-template)")
        return render_chat_template(template, messages, add_generation_prompt, continue_final_message,
                                    bos_token=self._text_or_empty(self.bos_token_id),
                                    eos_token=self._text_or_empty(self.eos_token_id), **extra)

    def _text_or_empty(self, token_id: int | None) -> str:
        return (self._tk.id_to_token(token_id) or "") if token_id is not None else ""

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], source: str = "GGUF") -> KVTokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind == "llama":  # SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma)
            tk, special = _sentencepiece_bpe(fields, fields.get("general.architecture"))
            return cls._from_gguf_tokenizer(tk, fields, special)
        if kind != "gpt2":
            raise ValueError(
                f"{source}: tokenizer model {kind!r} is not supported from GGUF metadata (kvpage reads byte-level "
                "BPE, 'gpt2', and SentencePiece BPE, 'llama'); use a Hugging Face directory with tokenizer.json"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tk.pre_tokenizer = _byte_level_pre(fields.get("tokenizer.ggml.pre"))
        tk.decoder = decoders.ByteLevel()
        special = {i for i, t in enumerate(types) if t in _SPECIAL_TYPES}
        tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
        return cls._from_gguf_tokenizer(tk, fields, special)

    @classmethod
    def _from_gguf_tokenizer(cls, tk: Tokenizer, fields: dict[str, Any], special: set[int]) -> KVTokenizer:
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        eos_ids = [int(x) for x in (eos, eot) if x is not None]
        return cls(tk, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=list(dict.fromkeys(eos_ids)),
                   add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=fields.get("tokenizer.chat_template"), special_ids=special)

    @classmethod
    def from_gguf(cls, path: str | Path) -> KVTokenizer:
        from kvpage.model.config import open_gguf

        fields = {k: v for k, v in open_gguf(Path(path)).fields.items()
                  if k.startswith("tokenizer.") or k == "general.architecture"}
        return cls.from_gguf_fields(fields, source=str(path))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> KVTokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        tk = Tokenizer.from_file(str(tj))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return tk.token_to_id(text) if text else None

        bos = token_id(cfg.get("bos_token")) or model_cfg.get("bos_token_id")
        eos_ids: list[int] = []
        for src in (gen.get("eos_token_id"), model_cfg.get("eos_token_id"), token_id(cfg.get("eos_token"))):
            for x in src if isinstance(src, list) else [src]:
                if x is not None and x not in eos_ids:
                    eos_ids.append(int(x))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        special = {tok.content for tok in tk.get_added_tokens_decoder().values() if tok.special}
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # tokenizer.json's post-processor adds BOS itself when configured
            add_bos = False
        return cls(tk, bos_token_id=bos, eos_token_ids=eos_ids, add_bos_token=bool(add_bos),
                   chat_template=template, special_ids={tk.token_to_id(s) for s in special})


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


class IncrementalDetokenizer:
    """Text deltas for a growing list of output tokens.

    Decodes a small window of recent tokens and holds text back while it ends in an incomplete UTF-8
    sequence (U+FFFD), so a character split across tokens is emitted whole, once.
    """

    def __init__(self, tokenizer: KVTokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        context = list(prompt_ids[-6:])  # a little prompt context keeps leading-space rules right
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end becomes U+FFFD)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta

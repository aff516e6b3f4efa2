"""The SmolLM2 tokenizer read from GGUF metadata, checked against transformers' GGUF tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.model.tokenizer import IncrementalDetokenizer, KVTokenizer, render_chat_template

TEXTS = [
    "Hello world!",
    "The KV cache, not compute, caps concurrency.",
    "東京は日本の首都です。",
    "Café naïve façade — “quotes” and ‘apostrophes’",
    "emoji 🤖🎉👍🏽 family 👨‍👩‍👧",
    "def f(x):\n    return x * 2\n\n\n# done",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nHi there<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok(smol_fp32) -> KVTokenizer:
    return smol_fp32.tokenizer


@pytest.fixture(scope="module")
def hf_tok(smol_fp32):
    from transformers import AutoTokenizer

    path = smol_fp32.path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_special_ids_and_template(tok):
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and not tok.add_bos_token
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.vocab_size == 49152


def test_matches_transformers_on_text_without_digits(tok, hf_tok):
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text


def test_digits_are_split_one_by_one_as_llama_cpp_does(tok):
    # SmolLM2's own tokenizer (and llama.cpp's "smollm" pre-tokenizer) give every digit its own token;
    # transformers' generic GGUF conversion does not, which is why the comparison above avoids digits.
    ids = tok.encode("2024")
    assert len(ids) == 4 and tok.decode(ids) == "2024"


def test_decode_roundtrip_and_special_skipping(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("<|im_start|>user"), skip_special_tokens=True) == "user"


def test_chat_template_matches_transformers(tok, hf_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☕"}]
    ours = tok.apply_chat_template(messages)
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n")


def test_chat_template_errors_are_clear(tok):
    with pytest.raises(ValueError, match="list of"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="refused the messages: nope"):
        render_chat_template("{{ raise_exception('nope') }}", [], True)
    with pytest.raises(ValueError, match="does not compile"):
        render_chat_template("{% for %}", [], True)
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat_template("{{ messages[5].content }}", [], True)


def test_incremental_detokenization_emits_whole_characters(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        d = IncrementalDetokenizer(tok, skip_special_tokens=False)
        deltas = [d.add(i) for i in ids] + [d.flush()]
        assert "".join(deltas) == text
        assert not any("\ufffd" in x for x in deltas), deltas


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40))
def test_incremental_detokenization_property(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Prompt: "), skip_special_tokens=False)
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert out == tok.decode(ids, skip_special_tokens=False)


# ------------------------------------------------------------ chat templates
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "The color I pick is"}]


def test_continue_final_message_matches_transformers(tok, hf_tok):
    ours = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False, continue_final_message=True)
    ref = hf_tok.apply_chat_template(CONVERSATION, tokenize=False, continue_final_message=True)
    assert ours == ref and ours.endswith("<|im_start|>assistant\nThe color I pick is")
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="last message with text"):
        tok.apply_chat_template([*CONVERSATION[:2], {"role": "assistant", "content": ""}],
                                add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="does not reproduce"):  # a template that drops the last message
        tok.apply_chat_template(CONVERSATION, add_generation_prompt=False, continue_final_message=True,
                                chat_template="{{ messages[0].content }}")


def test_a_given_template_replaces_the_models(tok):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    ours = tok.apply_chat_template(CONVERSATION[:2], chat_template=template)
    assert ours == "<system>Be brief.\n<user>Name a color.\n"
    assert tok.apply_chat_template(CONVERSATION[:2]).startswith("<|im_start|>system")  # the model's, untouched

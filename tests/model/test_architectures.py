"""Architecture coverage on tiny random checkpoints, each checked token for token against transformers:
Llama with llama3 RoPE scaling and MQA, Qwen2 with q/k/v biases, Mistral, tied embeddings; loaded from a
Hugging Face directory and from GGUF (F32 and quantized)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvpage.model.loader import load_model
from kvpage.model.tokenizer import KVTokenizer
from tests.helpers.paged_driver import generate
from tests.helpers.tiny_models import make_hf_model, write_gguf

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
CASES = {
    "llama3-mqa": dict(arch="llama", kv_heads=1, rope=LLAMA3_ROPE),
    "qwen2-bias": dict(arch="qwen2", kv_heads=2),
    "mistral-gqa": dict(arch="mistral", kv_heads=2),
    # a uniform sliding window of 24 positions: blocks leave the table as the window passes them
    "mistral-window": dict(arch="mistral", kv_heads=2, window=24),
    "llama-tied": dict(arch="llama", kv_heads=4, tied=True),
}


def hf_greedy(model, prompts, max_new):
    out = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                               eos_token_id=1, pad_token_id=1)
        out.append(g[0, len(p):].tolist())
    return out


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 40, 100)]  # 100 > llama3's original 32


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(path, **CASES[request.param])
    return request.param, path, model


def test_hf_directory_matches_transformers(tiny):
    name, path, model = tiny
    lm = load_model(str(path), dtype="float32")
    assert lm.config.architecture == CASES[name]["arch"]
    prompts = random_prompts(lm.config.vocab_size)
    ref = hf_greedy(model, prompts, 12)
    assert generate(lm, prompts, 12, block_size=4) == ref
    assert generate(lm, prompts, 12, block_size=16, chunk=7) == ref


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_1"])
def test_gguf_matches_transformers_on_the_same_weights(tiny, tmp_path, quant):
    name, path, model = tiny
    if name.startswith("mistral") and quant != "F32":
        pytest.skip("one architecture is enough for the quantized formats")
    gguf_path = tmp_path / f"{name}-{quant}.gguf"
    readback = write_gguf(model, path, gguf_path, quant=quant)
    ref_model = type(model)(model.config).eval()
    missing = ref_model.load_state_dict(readback, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}  # tied models share it with the embeddings
    ref_model.tie_weights()
    lm = load_model(str(gguf_path), dtype="float32")
    prompts = random_prompts(lm.config.vocab_size, seed=1)
    assert generate(lm, prompts, 12, block_size=8) == hf_greedy(ref_model, prompts, 12)


def test_gguf_and_hf_tokenizers_agree(tiny, tmp_path):
    _, path, model = tiny
    gguf_path = tmp_path / "tok.gguf"
    write_gguf(model, path, gguf_path)
    from_gguf = KVTokenizer.from_gguf(gguf_path)
    from_json = KVTokenizer.from_hf_dir(path)
    texts = ("the quick brown fox", "caf\u00e9 \u6771\u4eac 1234", "<|user|>paged attention</s>", "  spaces\n\nlines")
    for text in texts:
        assert from_gguf.encode(text) == from_json.encode(text)
        assert from_gguf.encode(text)[0] == 0  # add_bos_token
        plain = from_gguf.encode(text, add_special_tokens=False)
        assert from_gguf.decode(plain, skip_special_tokens=False) == text
    assert from_json.bos_token_id == 0 and from_json.eos_token_ids == (1,)
    assert from_json.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>hi</s>"


def test_unsupported_architecture_is_refused(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
        "intermediate_size": 16, "vocab_size": 10}))
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_missing_weights_are_named(tmp_path: Path):
    model = make_hf_model(tmp_path, "llama")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    del model
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path))


def test_preset_and_missing_paths_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="preset"):
        load_model("Llama-3-8B")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))


def test_dequantization_formats_and_unsupported_types():
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from kvpage.model.dequant import dequantize

    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for q in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        data = gguf.quants.quantize(x, q)
        ours = dequantize(data, q, (8, 64)).numpy()
        assert np.array_equal(ours, gguf.quants.dequantize(data, q).reshape(8, 64)), q.name
        assert np.abs(ours - x).max() < 0.5
    with pytest.raises(ValueError, match="GGUF tensor type Q8_K cannot be dequantized"):
        dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), dtype=np.uint8), Q.Q8_K, (256,))

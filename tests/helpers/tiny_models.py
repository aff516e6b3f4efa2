"""Tiny random Llama-family checkpoints built on the spot: a Hugging Face directory (config.json,
safetensors, tokenizer.json) and the same weights as a GGUF file, laid out the way llama.cpp writes them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention keeps a block table per sequence",
    "tokens flow through layers and leave keys and values behind",
    "caf\u00e9 na\u00efve \u6771\u4eac 123 456 7890",
] * 20


def train_tokenizer(path: Path, vocab_size: int = 320) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<|user|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}</s>{% endif %}",
    }))
    return tk.get_vocab_size()


def make_hf_model(path: Path, arch: str, *, kv_heads: int = 2, tied: bool = False, rope: dict | None = None,
                  seed: int = 0, window: int | None = None, heads: int = 4, head_dim: int = 16):
    """Save a random model of ``arch`` (llama | qwen2 | mistral) with its tokenizer; return the model.
    ``window``: Mistral's sliding window."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    path.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(path)
    common = dict(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  num_hidden_layers=2,
                  intermediate_size=128, vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=tied,
                  initializer_range=0.2, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=500000.0, rope_scaling=rope)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=1e6)
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=window)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows (interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model, hf_dir: Path, out: Path, *, quant: str = "F32") -> dict[str, torch.Tensor]:
    """Write the model as GGUF; returns the weights as llama.cpp will read them back (dequantized), in HF
    names, so a reference model can be given exactly those values."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = hf_model.config
    arch = "qwen2" if cfg.model_type == "qwen2" else "llama"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    added = {a["id"]: a["content"] for a in tok["added_tokens"]}
    for i, t in added.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)

    qtype = {"F32": Q.F32, "F16": Q.F16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1}[quant]
    readback: dict[str, torch.Tensor] = {}

    def put(gguf_name: str, hf_name: str, t: torch.Tensor, permute: int = 0, quantize: bool = True) -> None:
        a = t.detach().float().numpy()
        if permute:
            a = _permute_qk(a, permute)
        kind = qtype if quantize and a.ndim == 2 else Q.F32
        data = gguf.quants.quantize(a, kind) if kind != Q.F32 else a
        w.add_tensor(gguf_name, data, raw_dtype=kind if kind != Q.F32 else None)
        back = gguf.quants.dequantize(data, kind).reshape(a.shape) if kind != Q.F32 else a
        if permute:  # undo, to give the reference the same values in HF order
            back = back.reshape(permute, back.shape[0] // permute // 2, 2, *back.shape[1:]).swapaxes(1, 2)
            back = back.reshape(a.shape)
        readback[hf_name] = torch.from_numpy(np.ascontiguousarray(back))

    sd = hf_model.state_dict()
    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            for suffix in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{suffix}"
                if key not in sd:
                    continue
                heads = 0
                if arch == "llama" and gg in ("attn_q", "attn_k"):
                    heads = cfg.num_attention_heads if gg == "attn_q" else cfg.num_key_value_heads
                put(f"blk.{i}.{gg}.{suffix}", key, sd[key], permute=heads if suffix == "weight" else 0,
                    quantize=suffix == "weight")
    if rope.get("rope_type") == "llama3":  # llama.cpp stores the llama3 divisors as a tensor
        from kvpage.model.rope import rope_inv_freq

        head_dim = cfg.hidden_size // cfg.num_attention_heads
        base = rope_inv_freq(head_dim, float(rope["rope_theta"]))
        scaled = rope_inv_freq(head_dim, float(rope["rope_theta"]), rope)
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert math.isfinite(float(next(iter(readback.values())).sum()))
    return readback

"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat batch and a paged KV cache.

Parameter names follow Hugging Face's (``layers.N.self_attn.q_proj`` ...) so safetensors checkpoints load
as they are and GGUF tensors are renamed to them. The arithmetic follows transformers' Llama step by step
(float32 RMSNorm, rotate-half RoPE, SwiGLU) so fp32 outputs can be compared token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention.backends.base import AttentionBackend
from kvpage.attention.metadata import AttentionMetadata
from kvpage.model.config import ModelConfig
from kvpage.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq


class PackedLinear(nn.Module):
    """Inference-only linear layer on a oneDNN pre-packed bf16 weight: same results as F.linear, about twice
    as fast on this CPU, because the weight is laid out for the GEMM once instead of at every call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_available() -> bool:
    try:
        w = torch.ones(4, 4, dtype=torch.bfloat16)
        PackedLinear(w, None)(torch.ones(1, 4, dtype=torch.bfloat16))
        return True
    except Exception:
        return False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def pack(self) -> None:
        bias = None
        if self.q_proj.bias is not None:
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        self.qkv = PackedLinear(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]), bias)
        self.o_packed = PackedLinear(self.o_proj.weight, None)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def fast_forward(self, x, cos, sin, kv_cache, meta, ops) -> torch.Tensor:
        t, hd, kd = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(x)
        q = qkv[:, :hd].view(t, self.num_heads, self.head_dim)
        k = qkv[:, hd : hd + kd].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, hd + kd :].view(t, self.num_kv_heads, self.head_dim)
        ops.rotary_(q, k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_packed(out.reshape(t, hd))

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def pack(self) -> None:
        self.gate_up = PackedLinear(torch.cat([self.gate_proj.weight, self.up_proj.weight]), None)
        self.down = PackedLinear(self.down_proj.weight, None)
        del self.gate_proj, self.up_proj, self.down_proj

    def fast_forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        gu = self.gate_up(x)
        if gu.dtype == torch.bfloat16:  # fused: the product is rounded to bf16 either way
            return self.down(ops.silu_mul(gu))
        inter = gu.shape[-1] // 2
        return self.down(F.silu(gu[:, :inter]) * gu[:, inter:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta):
        # x is the float32 residual stream; the projections run in the weights' dtype.
        w = self.post_attention_layernorm.weight.dtype
        x = x + self.self_attn(self.input_layernorm(x).to(w), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x).to(w))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rope_freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, rope_freq_factors))
        self.fast_ops = None  # set by enable_fast_path()

    def enable_fast_path(self, ops) -> None:
        """bf16 inference path: packed fused projections and fused norm / RoPE / SiLU kernels (``ops``)."""
        for layer in self.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_packed = PackedLinear(weight, None)
        self.final_norm_f32 = self.norm.weight.float()  # final hidden stays float32 for exact top logits
        self.fast_ops = ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm (float32), one row per token of the flat batch.

        The residual stream, the norms and the logits stay in float32 whatever the weights' dtype (as in
        llama.cpp); with bf16 weights only the matrix products and attention run in bf16.
        """
        if self.fast_ops is not None:
            return self._fast_forward(input_ids, positions, kv_caches, meta)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        x = x.float()
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def _fast_forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        ops = self.fast_ops
        residual = self.embed_tokens(input_ids).float()
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        layers = self.layers
        h = ops.rms_norm(residual, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            a = layer.self_attn.fast_forward(h, cos, sin, kv_cache, meta, ops)
            post = layer.post_attention_layernorm
            h = ops.add_rms_norm(a, residual, post.weight, post.eps)
            m = layer.mlp.fast_forward(h, ops)
            if i + 1 < len(layers):
                nxt = layers[i + 1].input_layernorm
                h = ops.add_rms_norm(m, residual, nxt.weight, nxt.eps)
            else:
                h = ops.add_rms_norm(m, residual, self.final_norm_f32, self.norm.eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits_ex(hidden).logits

    def compute_logits_ex(self, hidden: torch.Tensor) -> LogitsResult:
        """float32 logits with each row's argmax and log-sum-exp.

        With bf16 weights the matmul's output is rounded to 8 mantissa bits (~0.06 at a logit of 15), enough
        to flip near-ties; entries within that rounding distance of each row's maximum are recomputed exactly
        in float32 from the float32 hidden state, so greedy choices and top logprobs do not depend on it.
        """
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        ops = self.fast_ops or _kernels()
        if self.fast_ops is not None:
            raw = self.lm_packed(hidden.to(weight.dtype))
        else:
            raw = F.linear(hidden.to(weight.dtype), weight)
        if raw.shape[0] == 0:
            return LogitsResult(raw.float(), torch.zeros(0, dtype=torch.long), torch.zeros(0))
        if ops is not None:
            if raw.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
                logits, amax, lse = ops.logits_postprocess(raw, hidden.float(), weight)
            else:
                logits, amax, lse = ops.logits_postprocess(raw.float(), hidden, weight)
            return LogitsResult(logits, amax, lse)
        logits = raw.float()
        if weight.dtype != torch.float32:
            top = logits.max(dim=-1, keepdim=True).values
            rows, cols = (logits >= top - top.abs() / 32 - 1e-3).nonzero(as_tuple=True)
            logits[rows, cols] = (hidden[rows].float() * weight[cols].float()).sum(dim=-1)
        return LogitsResult(logits, logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1))


@dataclass
class LogitsResult:
    logits: torch.Tensor  # [rows, vocab] float32
    argmax: torch.Tensor  # [rows] int64
    lse: torch.Tensor  # [rows] float32: log-sum-exp, so logprob(t) = logits[t] - lse


def _kernels():
    try:
        from kvpage.attention.backends.cpu_kernels import load_kernels

        return load_kernels()
    except Exception:  # pragma: no cover - import problems fall back to torch
        return None

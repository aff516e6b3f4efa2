"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat batch and a paged KV cache.

Parameter names follow Hugging Face's (``layers.N.self_attn.q_proj`` ...) so safetensors checkpoints load
as they are and GGUF tensors are renamed to them. The arithmetic follows transformers' Llama step by step
(float32 RMSNorm, rotate-half RoPE, SwiGLU) so fp32 outputs can be compared token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention.backends.base import AttentionBackend
from kvpage.attention.kv_transform import LayerAttend
from kvpage.model.config import ModelConfig
from kvpage.model.logits import LogitsBuffer, LogitsResult, RowDraws, lm_head_logits
from kvpage.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from kvpage.ops import Kernels

if TYPE_CHECKING:
    from kvpage.model.fast_path import FastPath


class RMSNorm(nn.Module):
    """x / rms(x) * w, the division in float32 (as transformers' LlamaRMSNorm: w applied in x's dtype)."""

    def __init__(self, dim: int, eps: float, init: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), init))
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32: the part every RMSNorm variant shares."""
        h = x.to(torch.float32)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


class Attention(nn.Module):
    """Self-attention over the paged cache. Options for the models that share it: ``qk_norm`` builds a norm over
    each query and key head, applied before RoPE (Gemma 3's QK-norm); ``scale`` replaces head_dim ** -0.5;
    ``o_bias`` gives the output projection a bias (Qwen2 has biases on q/k/v only)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 qk_norm: Callable[[int, float], nn.Module] | None = None, scale: float | None = None,
                 o_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm = None if qk_norm is None else qk_norm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = None if qk_norm is None else qk_norm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.backend = backend
        # the backend call, with a quantized cache's transform
        self.attend = LayerAttend(backend.forward, backend.transform_rows)

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), SiLU unless the model says otherwise (Gemma: GELU-tanh)."""

    def __init__(self, cfg: ModelConfig, act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


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
        # Built on the meta device and loaded with assign=True: skip the random init, whose normal_ on meta
        # tensors imports torch._dynamo (~1.2 s of every cold start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, rope_freq_factors))
        self.ops: Kernels | None = None  # the compiled kernels, where they build (set by the loader)
        self.fast: FastPath | None = None  # the fast path, where the loader enabled it (model/fast_path.py)
        # the lm head's product (x, weight) -> raw logits; tensor parallelism's vocabulary-parallel one computes
        # a rank's slice and gathers the slices on rank 0 (distributed/group.py)
        self.lm_product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear

    @property
    def fast_ops(self) -> Kernels | None:
        """The kernels the fast path runs on; None on the reference path."""
        return None if self.fast is None else self.fast.ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[Any]) -> torch.Tensor:
        """Hidden states after the final norm (float32), one row per token of the flat batch; ``metas[i]`` is
        what the attention backend's metadata builder made of the step for layer i's KV group.

        The residual stream, the norms and the logits stay in float32 whatever the weights' dtype (as in
        llama.cpp); with bf16 weights only the matrix products and attention run in bf16.
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        x = x.float()
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits_ex(hidden).logits

    def compute_logits_ex(self, hidden: torch.Tensor, argmax_only: bool = False,
                          buffer: LogitsBuffer | None = None, draws: RowDraws | None = None) -> LogitsResult:
        """float32 logits, argmax and log-sum-exp of the lm head (model/logits.py, lm_head_logits)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_head_logits(self.lm_product, hidden, weight, self.ops, argmax_only, buffer, draws)

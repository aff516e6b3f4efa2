"""Gemma 3 (text) over a flat batch and a paged KV cache: the readable reference, step by step as transformers'
Gemma3ForCausalLM computes it, so float32 outputs compare token for token.

What differs from Llama (model/llama.py): embeddings scaled by sqrt(hidden); RMSNorm computed in float32 and
scaled by (1 + w); a norm before and after each sublayer (four per layer); RMSNorm over each query and key
head before RoPE (QK-norm); a GELU-tanh gated MLP; the attention scale query_pre_attn_scalar ** -0.5; and
two layer kinds: sliding-window layers (RoPE base rope_local_theta) and global ones (rope_theta). Which
layers see how far back is the KV layout's business (kv/specs.py): each layer's attention metadata carries its
group's window.

Parameter names follow Hugging Face's; GGUF norms store 1 + w and are shifted back on load (model/weights.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention.backends.base import AttentionBackend
from kvpage.model.config import SLIDING, ModelConfig
from kvpage.model.llama import MLP, Attention, RMSNorm
from kvpage.model.logits import LogitsBuffer, LogitsResult, RowDraws, lm_head_logits
from kvpage.model.rope import RotaryEmbedding, rope_inv_freq
from kvpage.ops import Kernels


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), all in float32, returned in x's dtype (w is stored less one: zeros are identity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, init=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).type_as(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, backend, qk_norm=GemmaRMSNorm, scale=cfg.attention_scale,
                                   o_bias=cfg.attention_bias)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg, act=gelu_tanh)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        # x is the float32 residual stream; the sublayers run in the weights' dtype.
        w = self.input_layernorm.weight.dtype
        a = self.self_attn(self.input_layernorm(x.to(w)), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(a).float()
        m = self.mlp(self.pre_feedforward_layernorm(x.to(w)))
        return x + self.post_feedforward_layernorm(m).float()


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rope_freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None  # tied to the embeddings
        self.rotary = RotaryEmbedding(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, rope_freq_factors))
        self.rotary_local = RotaryEmbedding(rope_inv_freq(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, None))
        self.sliding = [cfg.layer_type(i) == SLIDING for i in range(cfg.num_layers)]
        self.ops: Kernels | None = None
        self.lm_product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear  # as llama.py's
        self.fast = None  # the fast path, where the loader enabled it (model/gemma3_fast.py)

    @property
    def fast_ops(self) -> Kernels | None:
        return None if self.fast is None else self.fast.ops

    def reset_rope(self, rope_freq_factors: torch.Tensor | None = None) -> None:
        """Buffers built on the meta device hold no values: compute both RoPE tables for real."""
        cfg = self.config
        self.rotary.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                              rope_freq_factors), persistent=False)
        self.rotary_local.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_local_theta
                                                                    or cfg.rope_theta, None), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[Any]) -> torch.Tensor:
        """Hidden states after the final norm (float32), one row per token of the flat batch."""
        w = self.embed_tokens.weight
        # the scale in the weights' dtype, as transformers multiplies it
        x = self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size**0.5, dtype=w.dtype)
        glob = self.rotary.cos_sin(positions, w.dtype)
        local = self.rotary_local.cos_sin(positions, w.dtype)
        x = x.float()
        for layer, sliding, kv_cache, meta in zip(self.layers, self.sliding, kv_caches, metas, strict=True):
            cos, sin = local if sliding else glob
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits_ex(hidden).logits

    def compute_logits_ex(self, hidden: torch.Tensor, argmax_only: bool = False,
                          buffer: LogitsBuffer | None = None, draws: RowDraws | None = None) -> LogitsResult:
        """float32 logits, argmax and log-sum-exp from the tied embeddings (model/logits.py, lm_head_logits)."""
        return lm_head_logits(self.lm_product, hidden, self.embed_tokens.weight, self.ops, argmax_only, buffer, draws)

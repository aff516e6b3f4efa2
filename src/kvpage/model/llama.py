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
from kvpage.model.layers.linear import PackedLinear
from kvpage.model.quant import QuantWeight, concat
from kvpage.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from kvpage.ops import Kernels

# The wide output projection keeps oneDNN above this many rows, where oneDNN measured faster than kvpage's AMX
# tile GEMM (0.8-0.9x at 128-256 rows on the AMX Xeon: benchmarks/linear.py, BENCHMARKS.md).
AMX_LOGITS_MAX_ROWS = 64


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

    def pack(self, quant: dict[str, QuantWeight], prefix: str, ops) -> None:
        bias = None
        if self.q_proj.bias is not None:
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        qkv_quant = concat([quant.get(f"{prefix}.{p}_proj.weight") for p in "qkv"])
        self.qkv = PackedLinear(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]), bias,
                                qkv_quant, ops)
        self.o_packed = PackedLinear(self.o_proj.weight, None, quant.get(f"{prefix}.o_proj.weight"), ops)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj

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

    def pack(self, quant: dict[str, QuantWeight], prefix: str, ops) -> None:
        gate_up_quant = concat([quant.get(f"{prefix}.{p}_proj.weight") for p in ("gate", "up")])
        self.gate_up = PackedLinear(torch.cat([self.gate_proj.weight, self.up_proj.weight]), None, gate_up_quant, ops,
                                    gated=True)
        self.down = PackedLinear(self.down_proj.weight, None, quant.get(f"{prefix}.down_proj.weight"), ops)
        del self.gate_proj, self.up_proj, self.down_proj


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
        self.fast_ops: Kernels | None = None  # set by enable_fast_path()
        self._decode_layers = None  # the compiled layer stack for decode-only few-token steps (ditto)
        self._decode_backend = None  # its attention backend (decides the KV layout flag per call)
        self.lm_quant: QuantWeight | None = None

    def enable_fast_path(self, ops: Kernels, quant: dict[str, QuantWeight] | None = None) -> None:
        """The fast path (bf16, or float32 where the CPU has no native bf16): packed fused projections and fused
        norm / RoPE / SiLU kernels (``ops``); with ``quant`` (parameter name -> the checkpoint's quantized
        blocks) few-token steps compute from those."""
        quant = quant or {}
        for i, layer in enumerate(self.layers):
            layer.self_attn.pack(quant, f"layers.{i}.self_attn", ops)
            layer.mlp.pack(quant, f"layers.{i}.mlp", ops)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_packed = PackedLinear(weight, None, ops=ops, amx_max_rows=AMX_LOGITS_MAX_ROWS)
        self.lm_quant = quant.get("embed_tokens.weight" if self.lm_head is None else "lm_head.weight")
        self.final_norm_f32 = self.norm.weight.float()  # final hidden stays float32 for exact top logits
        self._fast_plan = []
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            self._fast_plan.append(_FastLayer(layer, nxt.weight if nxt else self.final_norm_f32,
                                              nxt.eps if nxt else self.norm.eps))
        self.fast_ops = ops
        self._decode_layers = self._compiled_decode_layers(ops) if ops.config.decode_layers == "compiled" else None

    def _compiled_decode_layers(self, ops: Kernels):
        """The layer stack for decode-only few-token steps as one compiled object, or None where a layer lacks
        quantized weights, the backend is not the compiled one, or the build predates it."""
        attn = self.layers[0].self_attn
        if (any(p.decode is None for p in self._fast_plan)
                or not all(layer.self_attn.backend.name == "cpu" for layer in self.layers)):
            return None
        first = self._fast_plan[0]
        stack = ops.decode_layers(first.in_norm, first.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                  attn.scale)
        for layer, p in zip(self.layers, self._fast_plan, strict=True):
            a, mlp = layer.self_attn, layer.mlp
            mats = [t for w in (a.qkv.quant, a.o_packed.quant, mlp.gate_up.quant, mlp.down.quant)
                    for t in (w.qs, w.d, w.m)]
            stack.add_layer(mats, p.post_norm, p.eps, p.next_norm, p.next_eps)
        self._decode_backend = attn.backend
        return stack

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
        # Plain objects and bound methods only: at one token per step, nn.Module call machinery and submodule
        # lookups cost as much as the small projections themselves.
        ops = self.fast_ops
        residual = self.embed_tokens(input_ids).float()
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        t = residual.shape[0]
        first = self._fast_plan[0]
        # steps of at most quant_max_tokens tokens: products straight from the quantized blocks where a layer
        # has them all (a GGUF may mix formats layer by layer; PackedLinear.forward sorts out the rest)
        few = t <= ops.config.quant_max_tokens
        if few and self._decode_layers is not None and not meta.fresh_prefills and not meta.cached_prefills:
            packed = self._decode_backend.packed_layout(kv_caches[0], first.in_norm.dtype)
            return self._decode_layers.run(residual, cos, sin, kv_caches, meta.slot_mapping, meta.block_tables,
                                           meta.query_start_loc, meta.seq_lens, ops.quant_int16, packed)
        h = ops.rms_norm(residual, first.in_norm, first.eps)
        for p, kv_cache in zip(self._fast_plan, kv_caches, strict=True):
            qkv_proj, o_proj, gate_up, down = p.decode if few and p.decode is not None else p.full
            qkv = qkv_proj(h)
            q = qkv[:, : p.q_end].view(t, p.num_heads, p.head_dim)
            k = qkv[:, p.q_end : p.k_end].view(t, p.num_kv_heads, p.head_dim)
            v = qkv[:, p.k_end :].view(t, p.num_kv_heads, p.head_dim)
            ops.rotary_(q, k, cos, sin)
            a = o_proj(p.attend(q, k, v, kv_cache, meta, p.scale).reshape(t, p.q_end))
            h = ops.add_rms_norm(a, residual, p.post_norm, p.eps)
            m = down(gate_up(h))  # silu(gate) * up
            h = ops.add_rms_norm(m, residual, p.next_norm, p.next_eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits_ex(hidden).logits

    def compute_logits_ex(self, hidden: torch.Tensor, argmax_only: bool = False) -> LogitsResult:
        """float32 logits with each row's argmax and log-sum-exp; with ``argmax_only`` (plain greedy steps)
        the compiled path returns only the argmax and never writes the [rows, vocab] float32 logits.

        With bf16 weights the matmul's output is rounded to 8 mantissa bits (~0.06 at a logit of 15), enough
        to flip near-ties; entries within that rounding distance of each row's maximum are recomputed exactly
        in float32 from the float32 hidden state, so greedy choices and top logprobs do not depend on it.
        """
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        ops = self.fast_ops or self.ops
        lm_quant = self.lm_quant
        if lm_quant is not None and 0 < hidden.shape[0] <= ops.config.quant_max_tokens:
            # float32 logits from the exact quantized weights (one row: 16-bit activation codes, ~2e-5 relative):
            # nothing near the maximum needs recomputing
            raw = ops.quant_linear(hidden, lm_quant.qs, lm_quant.d, lm_quant.m, True)
            return _result(*ops.logits_postprocess(raw, hidden, weight, not argmax_only), argmax_only)
        if self.fast_ops is not None:
            raw = self.lm_packed(hidden.to(weight.dtype))
        else:
            raw = F.linear(hidden.to(weight.dtype), weight)
        if raw.shape[0] == 0:
            return LogitsResult(raw.float(), torch.zeros(0, dtype=torch.long), torch.zeros(0))
        if ops is not None:
            if raw.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
                res = ops.logits_postprocess(raw, hidden.float(), weight, not argmax_only)
            else:
                res = ops.logits_postprocess(raw.float(), hidden, weight, not argmax_only)
            return _result(*res, argmax_only)
        logits = raw.float()
        if weight.dtype != torch.float32:
            top = logits.max(dim=-1, keepdim=True).values
            rows, cols = (logits >= top - top.abs() / 32 - 1e-3).nonzero(as_tuple=True)
            logits[rows, cols] = (hidden[rows].float() * weight[cols].float()).sum(dim=-1)
        return LogitsResult(logits, logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1))


class _FastLayer:
    """One decoder layer of the fast path as plain attributes and bound methods."""

    __slots__ = ("attend", "decode", "eps", "full", "head_dim", "in_norm", "k_end", "next_eps", "next_norm",
                 "num_heads", "num_kv_heads", "post_norm", "q_end", "scale")

    def __init__(self, layer: DecoderLayer, next_norm: torch.Tensor, next_eps: float) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv, attn.o_packed, mlp.gate_up, mlp.down)
        self.full = tuple(w.forward for w in linears)
        # Few-token steps call the quantized kernel directly when all four have the checkpoint's blocks and no
        # bias (under cProfile, PackedLinear.forward's own time was ~4% of a one-stream token); the gate_up
        # product applies the MLP's activation in its epilogue.
        self.decode = (tuple(_quant_projection(w.ops, w.quant, w.gated) for w in linears)
                       if all(w.quant is not None and w.bias is None for w in linears) else None)
        self.attend = attn.backend.forward
        self.in_norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.post_attention_layernorm.eps
        self.next_norm, self.next_eps = next_norm, next_eps
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_end = attn.num_heads * attn.head_dim
        self.k_end = self.q_end + attn.num_kv_heads * attn.head_dim
        self.scale = attn.scale


def _quant_projection(ops: Kernels, w: QuantWeight, gated: bool):
    """x -> the quantized kernel's product."""
    ql, qs, d, m = ops.quant_linear, w.qs, w.d, w.m
    return lambda x: ql(x, qs, d, m, False, gated)


@dataclass
class LogitsResult:
    logits: torch.Tensor | None  # [rows, vocab] float32; None when only the argmax was asked for
    argmax: torch.Tensor  # [rows] int64
    lse: torch.Tensor | None  # [rows] float32: log-sum-exp, so logprob(t) = logits[t] - lse


def _result(logits: torch.Tensor, argmax: torch.Tensor, lse: torch.Tensor, argmax_only: bool) -> LogitsResult:
    return LogitsResult(None, argmax, None) if argmax_only else LogitsResult(logits, argmax, lse)

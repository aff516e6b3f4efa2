"""The fast path of Gemma 3 (model/gemma3.py is the reference): packed projections (q|k|v, o, gate|up, down and
the 262k-row tied lm head: the AMX tile GEMM where the CPU has it, the int8 GEMM on the GGUF's Q5_0 / Q4_K / Q8_0
blocks on AVX-512 VNNI CPUs without it (Q6_K matrices and few-token steps: oneDNN's packed product)) and the
fused norm kernels, with each norm's ``1 + w`` folded once into a float32 weight (the sum transformers forms on
every call, so the norm's arithmetic is unchanged). The residual stream stays float32; the products run in the
weights' dtype.

The attention runs on the backend through each layer's KV-group metadata, as in the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpage.model.fast_path import AMX_LOGITS_MAX_ROWS, LOGITS_SPLIT_ROWS, few_token_logits, packed_logits
from kvpage.model.layers.linear import PackedLinear, gather_weights
from kvpage.model.lm_screen import LmScreen, screened_tokens
from kvpage.model.logits import LogitsBuffer, LogitsResult, RowDraws
from kvpage.model.quant import QuantWeight, concat
from kvpage.ops import Kernels

if TYPE_CHECKING:
    from kvpage.model.gemma3 import Gemma3ForCausalLM


def _one_plus(w: torch.Tensor) -> torch.Tensor:
    return (1.0 + w.float()).contiguous()


class _Layer:
    __slots__ = ("attend", "down", "eps", "gate_up", "head_dim", "k_end", "k_norm", "num_heads",
                 "num_kv_heads", "o", "post_attn", "post_ff", "pre_ff", "q_end", "q_norm", "qkv", "scale",
                 "sliding")


class Gemma3FastPath:
    """Gemma 3's layers as packed products and fused kernels under ``ops``."""

    def __init__(self, model: Gemma3ForCausalLM, ops: Kernels, quant: dict[str, QuantWeight] | None = None) -> None:
        self.model, self.ops = model, ops
        self.layers: list[_Layer] = []

        def blocks(*names: str) -> QuantWeight | None:
            """The GGUF's blocks for these matrices, in the one-code-per-weight form: only the int8 GEMM reads them
            here (few-token steps keep the packed bf16 product)."""
            qw = concat([(quant or {}).get(n) for n in names])
            return None if qw is None else qw.as_u8()

        for i, (layer, sliding) in enumerate(zip(model.layers, model.sliding, strict=True)):
            a, m = layer.self_attn, layer.mlp
            at, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
            p = _Layer()
            p.qkv = PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), None,
                                 blocks(f"{at}.q_proj.weight", f"{at}.k_proj.weight", f"{at}.v_proj.weight"), ops=ops)
            p.o = PackedLinear(a.o_proj.weight, None, blocks(f"{at}.o_proj.weight"), ops=ops)
            p.gate_up = PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), None,
                                     blocks(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), ops=ops,
                                     gated=True, activation="gelu_tanh")
            p.down = PackedLinear(m.down_proj.weight, None, blocks(f"{mlp}.down_proj.weight"), ops=ops)
            p.q_norm, p.k_norm = _one_plus(a.q_norm.weight), _one_plus(a.k_norm.weight)
            p.post_attn = _one_plus(layer.post_attention_layernorm.weight)
            p.pre_ff = _one_plus(layer.pre_feedforward_layernorm.weight)
            p.post_ff = _one_plus(layer.post_feedforward_layernorm.weight)
            p.eps = layer.input_layernorm.eps
            p.num_heads, p.num_kv_heads, p.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
            p.q_end = a.num_heads * a.head_dim
            p.k_end = p.q_end + a.num_kv_heads * a.head_dim
            p.scale, p.attend, p.sliding = a.scale, a.attend, sliding
            self.layers.append(p)
            del a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj
        # each layer's input norm, and the final one after the last layer
        self.in_norms = [_one_plus(layer.input_layernorm.weight) for layer in model.layers] + [_one_plus(
            model.norm.weight)]
        self.lm_weight = model.embed_tokens.weight
        self.lm_packed = PackedLinear(self.lm_weight, None, blocks("embed_tokens.weight"), ops=ops,
                                      amx_max_rows=AMX_LOGITS_MAX_ROWS, split_rows=LOGITS_SPLIT_ROWS,
                                      stream_out=True)
        # Few-token steps read the tied head's own Q8_0 blocks (178 MB against 335 MB of bf16 a token: the head is
        # most of what one stream's decode step reads), as SmolLM2's fast path does; float32 models keep their
        # panel GEMM, whose products give a row the same bits in any step.
        head_q = (quant or {}).get("embed_tokens.weight")
        self.lm_quant = (head_q if head_q is not None and head_q.few_token_ok
                         and self.lm_weight.dtype == torch.bfloat16 else None)
        # greedy steps' argmax on float32 heads (AVX2 builds): the head is ~60% of a decode row's products here
        self.lm_screen = LmScreen.build(ops, self.lm_weight)
        self.embed_scale = torch.tensor(model.config.hidden_size**0.5, dtype=self.lm_weight.dtype)
        if ops.config.weight_huge_pages:
            gather_weights([w for p in self.layers for w in (p.qkv, p.o, p.gate_up, p.down)] + [self.lm_packed])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metas: list) -> torch.Tensor:
        ops, model = self.ops, self.model
        dtype = self.lm_weight.dtype
        residual = (model.embed_tokens(input_ids) * self.embed_scale).float()
        glob = model.rotary.cos_sin(positions, torch.float32)
        local = model.rotary_local.cos_sin(positions, torch.float32)
        t = residual.shape[0]
        h = ops.rms_norm(residual, self.in_norms[0], self.layers[0].eps).to(dtype)
        for i, (p, kv_cache, meta) in enumerate(zip(self.layers, kv_caches, metas, strict=True)):
            qkv = p.qkv(h)
            cos, sin = local if p.sliding else glob
            q, k = ops.qk_norm_rope(qkv, p.q_norm, p.k_norm, p.eps, cos, sin, p.num_heads, p.num_kv_heads)
            v = qkv[:, p.k_end :].view(t, p.num_kv_heads, p.head_dim)
            a = p.o(p.attend(q, k, v, kv_cache, meta, p.scale).reshape(t, p.q_end))
            # residual += post-norm(attn); the MLP's input norm
            h = ops.norm_add_norm(a, residual, p.post_attn, p.pre_ff, p.eps, dtype)
            mid = p.gate_up(h)  # gelu_tanh(gate) * up
            # residual += post-norm(mlp); the next layer's input norm (the last: the final norm, kept float32)
            h = ops.norm_add_norm(p.down(mid), residual, p.post_ff, self.in_norms[i + 1], p.eps,
                                  dtype if i + 1 < len(self.layers) else torch.float32)
        return h

    def compute_logits_ex(self, hidden: torch.Tensor, argmax_only: bool = False,
                          buffer: LogitsBuffer | None = None, draws: RowDraws | None = None) -> LogitsResult:
        few = few_token_logits(self.ops, self.lm_quant, self.lm_weight, hidden, argmax_only, buffer, draws)
        if few is not None:
            return few
        if (screened := screened_tokens(self.lm_screen, self.ops, hidden, argmax_only)) is not None:
            return screened
        return packed_logits(self.ops, self.lm_packed, self.lm_weight, hidden, argmax_only, buffer, draws=draws)

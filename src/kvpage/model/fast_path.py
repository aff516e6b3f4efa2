"""The fast path over a loaded Llama-family model: packed fused projections (model/layers/linear.py), fused
norm / RoPE / SiLU kernels, products straight from the checkpoint's quantized blocks for few-token steps,
and, for decode-only few-token steps, the whole layer stack in one compiled call.

``LlamaForCausalLM`` (model/llama.py) stays the readable, step-by-step reference; the loader attaches a
``FastPath`` to it where the kernels build (``model.fast``), and the runner runs whichever the model has.
Packing replaces the reference projections, so a model with a fast path runs only that one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpage.model.layers.linear import PackedLinear, gather_weights
from kvpage.model.lm_screen import LmScreen, screened_tokens
from kvpage.model.logits import LogitsBuffer, LogitsResult, RowDraws, postprocess_raw
from kvpage.model.quant import QuantWeight, concat
from kvpage.ops import Kernels

if TYPE_CHECKING:
    from kvpage.model.llama import DecoderLayer, LlamaForCausalLM

# The wide output projection keeps oneDNN above this many rows. Since the tile GEMM writes the logits around the
# cache (stream_out), it is the faster of the two at every row count measured, 128-1024 (AMX Xeon, 2026-11-29,
# the head's product and logits pass, weights cold: SmolLM2 greedy 9.3 against 11.6-12.1 ms at 256 rows, 33-35
# against 60-68 ms at 1024; Gemma 3 48 against 56-58 ms at 256, 67 against 70-73 at 320); with plain stores it
# had been slower from 192 rows on. Beyond 1024 (prompt log-probabilities) is not measured.
AMX_LOGITS_MAX_ROWS = 1024
# oneDNN's lm-head product by vocabulary slices of this many rows: a slice's bf16 output at 256 rows is 16 MiB,
# under the 32 MiB up to which glibc's malloc reuses a freed block instead of mapping fresh pages each step.
LOGITS_SPLIT_ROWS = 32768


class FastPath:
    """The model's layers as packed products and fused kernels under ``ops``; with ``quant`` (parameter name ->
    the checkpoint's quantized blocks), few-token steps compute from those."""

    def __init__(self, model: LlamaForCausalLM, ops: Kernels, quant: dict[str, QuantWeight] | None = None) -> None:
        quant = quant or {}
        self.model = model
        self.ops = ops
        for i, layer in enumerate(model.layers):
            _pack_attention(layer, quant, f"layers.{i}.self_attn", ops)
            _pack_mlp(layer, quant, f"layers.{i}.mlp", ops)
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.lm_weight = weight
        self.lm_packed = PackedLinear(weight, None, quant.get("embed_tokens.weight" if model.lm_head is None
                                                              else "lm_head.weight"),
                                      ops=ops, amx_max_rows=AMX_LOGITS_MAX_ROWS, split_rows=LOGITS_SPLIT_ROWS,
                                      stream_out=True)
        self.lm_quant = self.lm_packed.quant  # the blocks as the packed head keeps them (as panels, say)
        self.lm_screen = LmScreen.build(ops, weight)  # greedy steps' argmax on float32 heads (AVX2 builds)
        if ops.config.weight_huge_pages:  # before the plan binds the few-token projections' blocks
            gather_weights([w for layer in model.layers for w in (layer.self_attn.qkv, layer.self_attn.o_packed,
                                                                  layer.mlp.gate_up, layer.mlp.down)]
                           + [self.lm_packed])
        self.final_norm_f32 = model.norm.weight.float()  # final hidden stays float32 for exact top logits
        self.plan: list[_FastLayer] = []
        for i, layer in enumerate(model.layers):
            nxt = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else None
            self.plan.append(_FastLayer(layer, nxt.weight if nxt else self.final_norm_f32,
                                        nxt.eps if nxt else model.norm.eps))
        compiled = ops.config.decode_layers == "compiled"
        self.amx_layers_max_rows = 0
        self.decode_layers = self._compiled_decode_layers() if compiled else None
        self.amx_layers = self._compiled_amx_layers() if compiled else None

    def _stack(self):
        """An empty compiled layer stack, or None where the layers cannot run as one: the backend is not the
        compiled one, or the layers are of more than one type (one plan serves every layer of a stack)."""
        layers = self.model.layers
        if not all(la.self_attn.backend.name == "cpu" for la in layers) or self.model.config.layer_types is not None:
            return None
        attn, first = layers[0].self_attn, self.plan[0]
        return self.ops.decode_layers(first.in_norm, first.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                      attn.scale)

    def _compiled_decode_layers(self):
        """The layer stack for decode-only few-token steps as one compiled object, or None where a layer lacks
        quantized weights or the layers cannot run as one stack."""
        stack = self._stack() if all(p.decode is not None for p in self.plan) else None
        if stack is None:
            return None
        for layer, p in zip(self.model.layers, self.plan, strict=True):
            a, mlp = layer.self_attn, layer.mlp
            mats = [t for w in (a.qkv, a.o_packed, mlp.gate_up, mlp.down) for t in (w.quant.qs, w.quant.d, w.quant.m)]
            stack.add_layer(mats, p.post_norm, p.eps, p.next_norm, p.next_eps)
        return stack

    def _compiled_amx_layers(self):
        """The layer stack for decode-only steps of more tokens (batched decode) on the AMX tile GEMM, or None
        where a projection would not take the tile GEMM at every row count (no packed operand, slices, a row
        limit, streamed outputs) or the layers cannot run as one stack. The Python loop cost ~2 ms of a batched
        decode step of ~55-85 ms (30 layers x ~10 calls, with their slicing and views), under the GIL with the
        second core idle (docs/model.md)."""
        linears = [(la.self_attn.qkv, la.self_attn.o_packed, la.mlp.gate_up, la.mlp.down) for la in self.model.layers]
        # steps of more rows than the layers' row limit (KVPAGE_AMX_LINEAR_MAX_ROWS) take the Python loop
        self.amx_layers_max_rows = min(w.amx_plain_rows for ws in linears for w in ws)
        if not self.amx_layers_max_rows:
            return None
        stack = self._stack()
        if stack is None:
            return None
        for ws, p in zip(linears, self.plan, strict=True):
            stack.add_amx_layer([t for w in ws for t in (w.amx, w.amx_bias)], ws[2].act, p.post_norm, p.eps,
                                p.next_norm, p.next_eps)
        return stack

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metas: list) -> torch.Tensor:
        """Hidden states after the final norm (float32), one row per token, as the reference model's forward.

        Plain objects and bound methods only: at one token per step, nn.Module call machinery and submodule
        lookups cost as much as the small projections themselves."""
        ops, model = self.ops, self.model
        residual = model.embed_tokens(input_ids).float()
        cos, sin = model.rotary.cos_sin(positions, torch.float32)
        t = residual.shape[0]
        first = self.plan[0]
        # steps of at most quant_max_tokens tokens: products straight from the quantized blocks where a layer
        # has them all (a GGUF may mix formats layer by layer; PackedLinear.forward sorts out the rest)
        few = t <= ops.config.quant_max_tokens
        meta = metas[0]
        # the compiled stack calls the backend's kernels itself: it passes the keys' rounding feedback of a quantized
        # cache's transform (attention/kv_transform.py) to its writes, but maps no rows: layers that do take the loop
        stack = self.decode_layers if few else self.amx_layers if t <= self.amx_layers_max_rows else None
        if stack is not None and meta.decode_only:
            feedback = self._stack_feedback(kv_caches[0].dtype)
            if feedback is not None:
                return stack.run(residual, cos, sin, kv_caches, meta.slot_mapping, meta.plan, ops.quant_int16,
                                 meta.packed, feedback)
        h = ops.rms_norm(residual, first.in_norm, first.eps)
        for p, kv_cache, meta in zip(self.plan, kv_caches, metas, strict=True):
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

    def _stack_feedback(self, dtype: torch.dtype) -> list | None:
        """What the compiled stack passes to its writes for caches of ``dtype``: [] (no transform), each layer's
        keys' rounding feedback, or None when a layer's transform maps rows (keys or values parts)."""
        ts = [p.attend.active(dtype) for p in self.plan]
        if all(t is None for t in ts):
            return []
        if any(t is not None and (t.keys is not None or t.values is not None) for t in ts):
            return None
        return [None if t is None else t.feedback for t in ts]

    def compute_logits_ex(self, hidden: torch.Tensor, argmax_only: bool = False,
                          buffer: LogitsBuffer | None = None, draws: RowDraws | None = None) -> LogitsResult:
        """As the reference model's, from the packed (or, for a few rows, the quantized) lm head."""
        few = few_token_logits(self.ops, self.lm_quant, self.lm_weight, hidden, argmax_only, buffer, draws)
        if few is not None:
            return few
        if (screened := screened_tokens(self.lm_screen, self.ops, hidden, argmax_only)) is not None:
            return screened
        return packed_logits(self.ops, self.lm_packed, self.lm_weight, hidden, argmax_only, buffer, draws=draws)


def few_token_logits(ops: Kernels, lm_quant: QuantWeight | None, weight: torch.Tensor, hidden: torch.Tensor,
                     argmax_only: bool, buffer: LogitsBuffer | None, draws: RowDraws | None) -> LogitsResult | None:
    """A step of at most quant_max_tokens rows through the head's own quantized blocks (what such a step costs is
    reading the head: Q8_0 is 1.06 bytes a weight against bf16's 2), or None where the step or the head does not
    qualify (``lm_quant``: blocks the few-token kernel reads, or None). float32 logits from the exact quantized
    weights (one row: 16-bit activation codes, ~2e-5 relative): nothing near the maximum needs recomputing."""
    if lm_quant is None or not 0 < hidden.shape[0] <= ops.config.quant_max_tokens:
        return None
    raw = ops.quant_linear(hidden, lm_quant.qs, lm_quant.d, lm_quant.m, True)
    return postprocess_raw(ops, raw, hidden, weight, argmax_only, buffer, draws)


# Steps whose head output takes up to this many bytes finish their float32 logits row by row with every
# vocabulary slice kept (fused_ops.cpp widen_finish_rows: 12 MB at 128 rows of SmolLM2's vocabulary), so each row
# is finished while it is in cache instead of read back from memory after the last slice; larger ones (prompt
# logprobs, Gemma 3's 262k vocabulary at many rows) keep one slice alive at a time.
ROW_MAJOR_LOGITS_MAX_BYTES = 32 << 20


def packed_logits(ops: Kernels, lm_packed: PackedLinear, weight: torch.Tensor, hidden: torch.Tensor,
                  argmax_only: bool, buffer: LogitsBuffer | None = None,
                  row_major_max_bytes: int = ROW_MAJOR_LOGITS_MAX_BYTES, draws: RowDraws | None = None) -> LogitsResult:
    """float32 logits (or only the argmax) from a packed lm head, exact near each row's maximum; the logits
    go to ``buffer`` when one is given. A head split by vocabulary slices keeps its slices and finishes the
    logits row by row up to ``row_major_max_bytes`` of head output; above that (and for the argmax alone) each
    slice's product is followed by its part of the logits pass, so one slice's output is alive at a time.
    With ``draws`` (up to the same size) each row's token is drawn in the row-by-row pass and no logits are
    returned; otherwise the logits are computed and ``tokens`` is None (the caller draws from them)."""
    rows, vocab = hidden.shape[0], lm_packed.out_features
    if rows == 0:
        return LogitsResult(torch.zeros(0, vocab), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    x = hidden.to(weight.dtype)
    if not lm_packed.splits(rows) or weight.dtype != torch.bfloat16:
        return postprocess_raw(ops, lm_packed(x), hidden, weight, argmax_only, buffer, draws)
    out = None if argmax_only or buffer is None else buffer.view(rows, vocab)
    h32 = hidden.float()
    if not argmax_only and rows * vocab * x.element_size() <= row_major_max_bytes:
        parts = [raw for _, raw in lm_packed.forward_parts(x)]
        if draws is not None and (res := draws.run(ops, parts, h32, weight)) is not None:
            return res
        logits, argmax, lse = ops.logits_postprocess(parts, h32, weight, True, out)
        return LogitsResult(logits, argmax, lse)
    row_max = torch.full((rows,), float("-inf"))
    best_value, best_index = torch.full((rows,), float("-inf")), torch.full((rows,), -1, dtype=torch.long)
    if out is None and not argmax_only:
        out = torch.empty(rows, vocab)
    for start, raw in lm_packed.forward_parts(x):
        ops.logits_scan(raw, start, vocab, h32, weight, row_max, best_value, best_index, out)
        del raw  # before the next slice's product: one slice's output alive at a time
    if argmax_only:
        return LogitsResult(None, best_index, None)
    argmax, lse = ops.logits_finish(out, h32, weight, row_max, True)
    return LogitsResult(out, argmax, lse)


def _pack_attention(layer: DecoderLayer, quant: dict[str, QuantWeight], prefix: str, ops: Kernels) -> None:
    a = layer.self_attn
    bias = None
    if a.q_proj.bias is not None:
        bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
    qkv_quant = concat([quant.get(f"{prefix}.{p}_proj.weight") for p in "qkv"])
    a.qkv = PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), bias, qkv_quant, ops)
    a.o_packed = PackedLinear(a.o_proj.weight, None, quant.get(f"{prefix}.o_proj.weight"), ops)
    del a.q_proj, a.k_proj, a.v_proj, a.o_proj


def _pack_mlp(layer: DecoderLayer, quant: dict[str, QuantWeight], prefix: str, ops: Kernels) -> None:
    m = layer.mlp
    gate_up_quant = concat([quant.get(f"{prefix}.{p}_proj.weight") for p in ("gate", "up")])
    m.gate_up = PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), None, gate_up_quant, ops, gated=True)
    m.down = PackedLinear(m.down_proj.weight, None, quant.get(f"{prefix}.down_proj.weight"), ops)
    del m.gate_proj, m.up_proj, m.down_proj


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
                       if all(w.quant is not None and w.bias is None for w in linears) else None)  # Q4 / Q8
        self.attend = attn.attend
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

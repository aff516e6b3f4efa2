"""The inference linear layer of the fast path: pre-packed weights, the path chosen by row count.

kvpage's AMX tile GEMM (csrc/linear/linear_amx.cpp) runs the layer projections up to 1,536 rows (1.1-1.6x
oneDNN's packed GEMM at 128-1,024 rows on the AMX Xeon: benchmarks/linear.py, BENCHMARKS.md); prompt steps of
more rows take oneDNN, which is faster there (0.75-0.86x the time at 2,048 rows; KVPAGE_AMX_LINEAR_MAX_ROWS, the
kernel configuration's amx_linear_max_rows), except products with a long inner dimension (ONEDNN_PROMPT_MAX_K);
the kernel configuration's amx_linear=False turns the tile GEMM off (side-by-side runs). On AVX-512 VNNI CPUs without
AMX, bf16 models with the checkpoint's Q4 / Q8 blocks run their many-row products on those blocks with int8
activation codes (csrc/linear/gemm_i8.cpp: ~2.5x oneDNN's bf16 GEMM on the Xeon without AMX), for the row counts
where it pays: the kernel configuration's i8_gemm ("auto": every row count on Intel CPUs; ops/kernels.py
int8_gemm_rows) decides. On AMD's Zen 4 kvpage's bf16 panel GEMM (csrc/linear/gemm_bf16.cpp, bf16_gemm) takes the
layer projections instead, at 1.1-1.7x oneDNN's speed there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from kvpage.model.layers.row_buckets import by_row_buckets, padded_rows
from kvpage.model.quant import QuantWeight
from kvpage.ops import ACT_GELU_TANH, ACT_NONE, ACT_SILU, I8_ALL_ROWS, Kernels
from kvpage.pages import gather_on_huge_pages

logger = logging.getLogger(__name__)

ACTIVATIONS = {"silu": ACT_SILU, "gelu_tanh": ACT_GELU_TANH}


_ALL_ROWS = I8_ALL_ROWS  # amx_max_rows (and i8_max_rows) when no limit is given
# Steps of more rows than KVPAGE_AMX_LINEAR_MAX_ROWS multiply on oneDNN only where the inner dimension is at most
# this: timed call by call inside offline runs (both products of each 2,048-row call, alternating which goes first;
# AMX Xeon, 2026-12-06), oneDNN took 0.56-0.68x the tile GEMM's time on SmolLM2's q|k|v and o and Gemma 3's
# q|k|v (K 576 / 640), 0.83-0.91x on the gate|up products and SmolLM2's down (K 1,536), but 1.29x on Gemma 3's
# down (K 2,048), which stays on the tile GEMM (and needs no second packing).
ONEDNN_PROMPT_MAX_K = 1536


def _onednn_product(packed: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """oneDNN's product on its packed weight, for by_row_buckets (oneDNN keeps a primitive per row count)."""
    return lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """Inference-only linear layer on pre-packed bf16 (or float32) weights: same results as F.linear up to float32
    summation order, about twice as fast on this CPU, because the weight is laid out for the product once
    instead of at every call. Paths by row count: the checkpoint's quantized blocks (a few rows, where reading
    fewer bytes wins), then the AMX tile GEMM where the CPU has it (bf16), the int8 GEMM on the quantized blocks
    (bf16 models on AVX-512 VNNI CPUs without AMX), kvpage's panel GEMMs for float32 on AVX2 builds and for bf16
    where bf16_gemm takes them (Zen 4), oneDNN otherwise (and above amx_max_rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: QuantWeight | None = None,
                 ops: Kernels | None = None, amx_max_rows: int | None = None, gated: bool = False,
                 split_rows: int | None = None, activation: str = "silu", stream_out: bool = False) -> None:
        super().__init__()
        # stream_out (lm heads): the AMX product writes its output around the cache, as it is read once, from
        # memory, by the logits pass (ops/csrc/linear/linear_amx.cpp)
        self.stream_out = stream_out
        # gated: weight = [gate; up] and the layer returns act(x Wg^T) * (x Wu^T), the MLP's input half, with act
        # `activation` (SiLU: Llama-family MLPs; GELU-tanh: Gemma's); the AMX path computes it in its epilogue
        # instead of writing both halves out for silu_mul / gelu_mul to read back, and so do the quantized and
        # int8 kernels for SiLU.
        self.gated = gated
        if gated and ops is None:
            raise ValueError("a gated PackedLinear needs the compiled kernels (silu_mul, gelu_mul)")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.act = ACTIVATIONS[activation] if gated else ACT_NONE
        self.fused_silu = gated and self.act == ACT_SILU  # the quantized and int8 kernels' gated epilogue
        self.out_features = weight.shape[0] // 2 if gated else weight.shape[0]
        self.bias = bias
        # The checkpoint's own quantized blocks: steps of at most config.quant_max_tokens tokens multiply Q4 / Q8
        # blocks directly (self.quant); the int8 GEMM reads every kind (self.i8).
        self.quant = quant if ops is not None and quant is not None and quant.few_token_ok else None
        self.quant_max_tokens = ops.config.quant_max_tokens if ops is not None else 0
        self.ops = ops
        # AMX operand order for up to amx_max_rows rows (None: all); oneDNN's packing only where it is used.
        self.amx: torch.Tensor | None = None
        self.amx_bias: torch.Tensor | None = None
        self.amx_max_rows = -1
        self.packed: torch.Tensor | None = None
        n, k = weight.shape
        if (amx_max_rows is None and ops is not None and ops.amx_linear_ok and ops.config.amx_linear_max_rows
                and not stream_out and k <= ONEDNN_PROMPT_MAX_K):
            amx_max_rows = ops.config.amx_linear_max_rows  # layer projections: oneDNN's packing above it too
        if (weight.dtype == torch.bfloat16 and n % 32 == 0 and k % 32 == 0 and not (gated and bias is not None)
                and ops is not None and ops.amx_linear_ok):
            self.amx = ops.amx_pack_gate_up(weight) if gated else ops.amx_pack_weight(weight)
            self.amx_max_rows = amx_max_rows if amx_max_rows is not None else _ALL_ROWS
            if bias is not None:
                self.amx_bias = bias.float()  # the kernel adds float32: converted once, not per call
        # bf16 models with quantized blocks on VNNI CPUs without AMX: the int8 GEMM (its own packing, kept in
        # place of oneDNN's: the bf16 weight itself stays with the model for exact logits and the reference)
        self.i8: tuple[torch.Tensor, torch.Tensor] | None = None
        if (self.amx is None and quant is not None and ops is not None and ops.i8_gemm_ok
                and weight.dtype == torch.bfloat16 and quant.shape == (n, k) and not (gated and n % 32)):
            self.i8 = ops.i8_pack_weight(quant.qs, quant.d, quant.m, self.fused_silu)
        # up to how many rows it takes them (oneDNN's packing above, where that is a limit)
        self.i8_max_rows = ops.i8_max_rows if self.i8 is not None else 0
        # float32 weights on AVX2 builds: kvpage's panel GEMM (ops/csrc/linear/gemm_f32.cpp; 1.1-1.65x oneDNN's packed
        # product on a pass of this model's layers at 1-2048 rows: benchmarks/linear.py --dtype float32),
        # oneDNN's packing otherwise.
        self.f32: torch.Tensor | None = None
        self.bf16: torch.Tensor | None = None  # kvpage's bf16 panel GEMM's operand (below)
        self.bf16_act = ACT_NONE  # its epilogue's activation (a gated packing)
        self.n = n
        if weight.dtype == torch.float32 and ops is not None and ops.f32_gemm_ok:
            self.f32 = ops.f32_pack_weight(weight.contiguous())
            # few-token steps then read the blocks in this GEMM's order and sums (model/quant.py, Panels): a
            # token row's outputs are the same bits whichever product its step takes
            panels = self.quant.as_panels() if self.quant is not None and ops.config.quant_panels else None
            self.quant = panels or self.quant
        # bf16 products on AVX512_BF16 CPUs without AMX: kvpage's panel GEMM above the int8 GEMM's rows
        # (ops/csrc/linear/gemm_bf16.cpp: 1.1-1.7x oneDNN's at 8-256 rows on a Zen 4), lm heads too, by vocabulary
        # slices (1.03-1.09x oneDNN's slices at 64-256 rows of Gemma 3's head, 1.00x at 1024; BENCHMARKS.md).
        elif (weight.dtype == torch.bfloat16 and self.amx is None and ops is not None and ops.bf16_gemm_ok
                and self.i8_max_rows < _ALL_ROWS and n % 16 == 0 and k % 2 == 0
                and (split_rows is None or split_rows % 16 == 0)):
            # gated without a bias: the activation in the GEMM's epilogue (the same bits as silu_mul after it)
            self.bf16_act = self.act if gated and bias is None and n % 32 == 0 else ACT_NONE
            self.bf16 = ops.bf16_pack_weight(weight, self.bf16_act != ACT_NONE)
        elif ((self.amx is None and self.i8_max_rows < _ALL_ROWS)
              or (self.amx is not None and amx_max_rows is not None)):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
        # split_rows (lm heads): the product also by slices of at most this many output features, for
        # forward_parts: outputs small enough for malloc to reuse step after step, where one [rows, 262144]
        # bf16 output is a fresh mapping faulted in page by page every step (oneDNN: ~20% of the product's
        # time; the AMX tile GEMM at 128 rows of Gemma 3's head, AMX Xeon: 50 ms whole, 33 ms into reused pages).
        # The AMX operand's 32-column blocks are contiguous, so its slices are views.
        splittable = split_rows is not None and n > split_rows and bias is None and not gated
        self.amx_split = split_rows if splittable and self.amx is not None and split_rows % 32 == 0 else None
        # the panel GEMM's operand is [n / 16, k / 2, 16, 2]: a slice of whole panels is a view
        self.bf16_split = split_rows if splittable and self.bf16 is not None else None
        self.packed_parts: list[tuple[int, torch.Tensor]] = []  # (first output feature, packed slice)
        if self.packed is not None and splittable:
            self.packed_parts = [(i, torch.ops.mkldnn._reorder_linear_weight(weight[i : i + split_rows].contiguous(),
                                                                            64)) for i in range(0, n, split_rows)]
            self.packed = None

    @property
    def amx_plain_rows(self) -> int:
        """Up to how many rows every call of more rows than the quantized steps take is one plain tile-GEMM
        product (a packed operand, no slices, no streamed output: what a compiled layer stack calls in its
        place); 0 where none is."""
        plain = self.amx is not None and self.amx_split is None and not self.stream_out
        return self.amx_max_rows if plain else 0

    def _on_amx(self, rows: int) -> bool:
        q = self.quant
        return rows <= self.amx_max_rows and (q is None or rows > self.quant_max_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        rows = x.shape[0]
        if self._on_amx(rows):
            if self.amx_split is not None:
                return torch.cat([part for _, part in self.forward_parts(x)], dim=1)
            return self.tile_product(x)
        if q is not None and rows <= self.quant_max_tokens:
            if self.bias is None and (self.fused_silu or not self.gated):  # SiLU in the kernel's epilogue
                return self.ops.quant_linear(x, q.qs, q.d, q.m, False, self.gated)
            out = self.ops.quant_linear(x, q.qs, q.d, q.m, False)
            if self.bias is not None:
                out = out + self.bias.to(x.dtype)
        elif rows <= self.i8_max_rows:  # SiLU in the kernel's epilogue
            out = self.ops.i8_linear(x, self.i8[0], self.i8[1], self.n, self.fused_silu, self.bias, self.stream_out)
            if self.fused_silu or not self.gated:
                return out
        elif self.f32 is not None:
            out = self.ops.f32_linear(x, self.f32, self.n, self.bias)
        elif self.bf16 is not None:
            if self.bf16_act != ACT_NONE:
                return self.ops.bf16_linear(x, self.bf16, self.n, None, self.bf16_act)
            out = self.ops.bf16_linear(x, self.bf16, self.n, self.bias)
        elif self.packed_parts:
            return torch.cat([part for _, part in self.forward_parts(x)], dim=1)
        else:
            return self.onednn_product(x)
        return self._activate(out)

    def tile_product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output on the AMX tile GEMM (with a gated layer's activation in its epilogue)."""
        return self.ops.amx_linear(x, self.amx, self.amx_bias, self.act, self.stream_out)

    def onednn_product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output on oneDNN's packing (rows in row_bucket's sizes), a gated layer's activation after."""
        return self._activate(by_row_buckets(x, _onednn_product(self.packed, self.bias)))

    def _activate(self, out: torch.Tensor) -> torch.Tensor:
        """A gated layer's act(gate) * up from a product's [gate; up] halves; other layers' output as it is."""
        if not self.gated:
            return out
        return self.ops.silu_mul(out) if self.act == ACT_SILU else self.ops.gelu_mul(out)

    def splits(self, rows: int) -> bool:
        """Whether a call with this many rows runs slice by slice (forward_parts): the AMX tile GEMM's, the bf16
        panel GEMM's or oneDNN's product."""
        if self._on_amx(rows):
            return self.amx_split is not None
        q = self.quant
        return ((bool(self.packed_parts) or self.bf16_split is not None)
                and not (q is not None and rows <= self.quant_max_tokens) and rows > self.i8_max_rows)

    def forward_parts(self, x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(first output feature, output slice) in order: the slices of split_rows where the call splits,
        else the whole output. Each slice is computed when asked for and not kept."""
        if not self.splits(x.shape[0]):
            yield 0, self.forward(x)
            return
        if self._on_amx(x.shape[0]):
            for start in range(0, self.n, self.amx_split):
                yield start, self.ops.amx_linear(x, self.amx[start : start + self.amx_split], stream=self.stream_out)
            return
        if self.bf16_split is not None:
            for start in range(0, self.n, self.bf16_split):
                width = min(self.bf16_split, self.n - start)
                yield start, self.ops.bf16_linear(x, self.bf16[start // 16 : (start + width) // 16], width, None)
            return
        xp = padded_rows(x)  # once for every slice
        for start, p in self.packed_parts:
            yield start, _onednn_product(p, None)(xp)[: x.shape[0]]


def gather_weights(linears: Sequence[PackedLinear]) -> int:
    """Moves the packed operands the layers' products stream (tile GEMM operands, quantized blocks and their
    scales, int8 and float32 panels) into one arena on 2 MiB pages, in the order given (the order a step reads
    them); returns the bytes advised onto huge pages. Why: a step reads every weight once, and on 4 KiB pages
    each 4 KiB of it is a TLB miss and a page walk that also holds up the GEMM's prefetch of the next block
    (kvpage/pages.py). oneDNN's packing is an opaque tensor and stays where it is. Call before anything binds
    the tensors themselves (the fast path's few-token projections do)."""
    streamed = []  # every operand, in order
    for lin in linears:
        q = lin.quant
        streamed += [t for t in (lin.amx, lin.f32, lin.bf16, *(lin.i8 or ()), *((q.qs, q.d, q.m) if q else ()))
                     if t is not None]
    unique = {id(t): t for t in streamed if t.layout == torch.strided and t.is_contiguous()}  # shared: copied once
    copies, advised = gather_on_huge_pages(list(unique.values()))
    moved = dict(zip(unique, copies, strict=True))

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else moved.get(id(t), t)

    for lin in linears:
        lin.amx, lin.f32, lin.bf16 = move(lin.amx), move(lin.f32), move(lin.bf16)
        if lin.i8 is not None:
            lin.i8 = (move(lin.i8[0]), move(lin.i8[1]))
        if lin.quant is not None:  # in place: the fast path holds the QuantWeight too
            q = lin.quant
            q.qs, q.d, q.m = move(q.qs), move(q.d), move(q.m)
    logger.info("packed weights: %.0f MB in one arena (%s)", sum(c.numel() * c.element_size() for c in copies) / 1e6,
                "on 2 MiB pages" if advised else "on the allocator's pages: transparent huge pages are off")
    return advised


def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN's packed linear runs for this dtype here (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        w = torch.ones(4, 4, dtype=dtype)
        PackedLinear(w, None)(torch.ones(1, 4, dtype=dtype))
        return True
    except Exception:
        return False

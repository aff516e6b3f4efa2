"""GGUF block-quantized weights kept as they are, for the few-token steps that are bound by reading weights.

One stream's decode step reads every weight once per token. From bf16 that is 270 MB per token for
SmolLM2-135M; from the file's own Q4_1 / Q8_0 blocks it is ~96 MB. The compiled ``quant_linear`` kernel
computes straight from these blocks in float32 on the exact weights (no bf16 rounding of them); larger
batches keep using the packed bf16 GEMM, which is compute-bound and faster there.

Layout (repacked once at load so the kernel reads aligned, homogeneous rows):
  Q4 (from Q4_0 and Q4_1): ``qs`` uint8 [N, K/2] (GGUF's nibble order), ``d``/``m`` float16 [N, K/32];
      weight = d * q + m (Q4_0's q - 8 becomes m = -8 d, exact in float16).
  Q8 (from Q8_0): ``qs`` int8 [N, K], ``d`` float16 [N, K/32]; weight = d * q.
  U8 (from Q5_0 and Q4_K, or a mix of kinds concatenated): ``qs`` uint8 [N, K], one code per weight,
      ``d``/``m`` float32 [N, K/32]; weight = d * q + m. Only the int8 GEMM (many-row steps) reads it; Q4_K's
      per-32 scale and min (super-block scale times a 6-bit factor) are exact in float32, not in float16.
  Panels (``as_panels``, float32 models on AVX2 builds): Q4 or Q8 in the float32 panel GEMM's order, 16 output
      columns per panel: ``qs`` uint8 [N/16, K, 8] (byte j of row k: column j's code in the low nibble, column
      j + 8's in the high) or int8 [N/16, K, 16]; ``d``/``m`` float16 [N/16, K/32, 16]. The kernel sums them as
      the panel GEMM sums the float32 weights, so few-token steps give many-token steps' bits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from kvpage.model.dequant import nibbles

# Steps with at most KernelConfig.quant_max_tokens tokens use the quantized kernels (the measured crossover:
# benchmarks/quant_linear.py); their activations go in as 16-bit integer blocks where the build has that
# kernel (AVX2: one integer product per pair of weights instead of a float conversion and FMA per weight;
# rounding <= 1.5e-5 of each 32-block's largest value), unless KernelConfig.quant_int16 is off.
QUANT_TYPES = {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K}
PANEL = 16  # output columns per panel of the float32 panel GEMM (ops/csrc/linear/gemm_f32.cpp)


@dataclass
class QuantWeight:
    qs: torch.Tensor  # uint8 [N, K/2] (Q4), int8 [N, K] (Q8) or uint8 [N, K] (U8)
    d: torch.Tensor  # float16 [N, K/32] (float32 for U8)
    m: torch.Tensor | None  # as d; None for Q8

    @property
    def kind(self) -> str:
        if self.qs.dim() == 3:
            return "q8p" if self.m is None else "q4p"
        if self.m is None:
            return "q8"
        return "u8" if self.qs.shape[1] == self.d.shape[1] * 32 else "q4"

    @property
    def few_token_ok(self) -> bool:
        """The few-token kernels (quant_linear, the compiled decode layers) read Q4 and Q8 only (as rows of
        blocks or as panels)."""
        return self.kind in ("q4", "q8", "q4p", "q8p")

    @property
    def shape(self) -> tuple[int, int]:
        if self.qs.dim() == 3:
            return self.qs.shape[0] * PANEL, self.qs.shape[1]
        return self.qs.shape[0], self.d.shape[1] * 32

    def codes(self) -> torch.Tensor:
        """One code per weight, [N, K] (uint8 for Q4, int8 for Q8), from rows of blocks."""
        n, k = self.shape
        return nibbles(self.qs.reshape(-1, 16)).reshape(n, k) if self.kind == "q4" else self.qs

    def as_panels(self) -> QuantWeight | None:
        """Q4 / Q8 rows of blocks in the float32 panel GEMM's order (module docstring), or None where N is not
        a multiple of 16."""
        n, k = self.shape
        if self.kind not in ("q4", "q8") or n % PANEL:
            return None
        q = self.codes().view(n // PANEL, PANEL, k)
        if self.kind == "q4":
            qs = (q[:, :8] | (q[:, 8:] << 4)).transpose(1, 2).contiguous()
        else:
            qs = q.transpose(1, 2).contiguous()

        def scales(t: torch.Tensor) -> torch.Tensor:
            return t.view(n // PANEL, PANEL, -1).transpose(1, 2).contiguous()

        return QuantWeight(qs, scales(self.d), None if self.m is None else scales(self.m))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def map_rows(self, fn) -> QuantWeight:
        """The same weight with its output rows rearranged by ``fn`` (a function of a [N, ...] tensor)."""
        return QuantWeight(fn(self.qs).contiguous(), fn(self.d).contiguous(),
                           None if self.m is None else fn(self.m).contiguous())

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (tests and diagnostics)."""
        n, k = self.shape
        if self.qs.dim() == 3:  # panels: back to rows
            if self.m is None:
                q = self.qs.float()
            else:
                q = torch.cat((self.qs & 0x0F, self.qs >> 4), dim=2).float()
            d = self.d.float().repeat_interleave(32, dim=1)
            w = q * d if self.m is None else q * d + self.m.float().repeat_interleave(32, dim=1)
            return w.transpose(1, 2).reshape(n, k)
        d = self.d.float()[:, :, None]
        if self.m is None:
            return (self.qs.view(n, -1, 32).float() * d).reshape(n, k)
        if self.kind == "u8":
            return (self.qs.view(n, -1, 32).float() * d + self.m.float()[:, :, None]).reshape(n, k)
        q = self.codes().view(n, -1, 32).float()
        return (q * d + self.m.float()[:, :, None]).reshape(n, k)

    def as_u8(self) -> QuantWeight:
        """The same weights as one unsigned code per weight with a float32 scale and offset per block (exact:
        Q8's q becomes q + 128 with offset -128 d)."""
        if self.kind == "u8":
            return self
        d = self.d.float()
        if self.m is None:  # q + 128 in one byte is q's bits with the top one flipped (one pass, no int16 copy)
            return QuantWeight(self.qs.view(torch.uint8) ^ 0x80, d, d * -128)
        return QuantWeight(self.codes(), d, self.m.float())


def concat(parts: list[QuantWeight | None]) -> QuantWeight | None:
    """Row-wise concatenation (fused q|k|v or gate|up); None unless every part is present with one K. Parts of
    one kind keep it; a mix becomes U8."""
    if not parts or any(p is None for p in parts) or len({p.shape[1] for p in parts}) != 1:
        return None
    if len({p.kind for p in parts}) != 1:
        parts = [p.as_u8() for p in parts]
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return QuantWeight(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte ``at`` of every block: [N, K/32]."""
    return blocks[:, :, at : at + 2].contiguous().view(torch.float16).reshape(blocks.shape[:2])


def from_gguf(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> QuantWeight | None:
    """The repacked blocks of one GGUF matrix ([out, in] in torch order), or None for other formats/shapes."""
    if qtype not in QUANT_TYPES or len(shape) != 2 or shape[1] % 32:
        return None
    with warnings.catch_warnings():  # the GGUF memory map is read-only; the blocks are only read (then copied)
        warnings.simplefilter("ignore", UserWarning)
        return _from_blocks(data, qtype, shape)


def _from_blocks(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> QuantWeight | None:
    n, k = shape
    if qtype == Q.Q4_K:
        return _from_q4_k(data, n, k)
    size = {Q.Q8_0: 34, Q.Q4_1: 20, Q.Q4_0: 18, Q.Q5_0: 22}[qtype]
    blocks = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).reshape(n, k // 32, size)
    d = _half(blocks, 0)
    if qtype == Q.Q8_0:
        return QuantWeight(blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, k), d, None)
    if qtype == Q.Q4_1:
        return QuantWeight(blocks[:, :, 4:].contiguous().reshape(n, k // 2), d, _half(blocks, 2))
    if qtype == Q.Q5_0:  # d, 32 high bits, 16 bytes of nibbles; value = d * (q - 16), q = nibble | bit << 4
        high = blocks[:, :, 2:6].contiguous().view(torch.int32)  # [n, nb, 1], bit j = element j's
        bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
        q = nibbles(blocks[:, :, 6:].reshape(-1, 16)).view(n, k // 32, 32) | (bits.to(torch.uint8) << 4)
        df = d.float()
        return QuantWeight(q.reshape(n, k), df, df * -16)
    # Q4_0: value = d * (q - 8) = d * q + (-8 d)
    return QuantWeight(blocks[:, :, 2:].contiguous().reshape(n, k // 2), d, (d.float() * -8).half())


def _from_q4_k(data: np.ndarray, n: int, k: int) -> QuantWeight | None:
    """Q4_K super-blocks of 256 (d, dmin, twelve bytes of 6-bit sub-block scales and mins, 128 bytes of
    nibbles) as U8: sub-block j of 32 has weight = (d sc_j) q - dmin mn_j, as ggml computes it."""
    if k % 256:
        return None
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).reshape(n, k // 256, 144)
    d, dmin = _half(raw, 0).float(), _half(raw, 2).float()  # [n, S]
    sc = raw[:, :, 4:16].to(torch.int32)  # [n, S, 12]
    low = sc[:, :, 0:4]
    mid = sc[:, :, 4:8]
    top = sc[:, :, 8:12]
    scale = torch.cat([low & 63, (top & 0x0F) | ((low >> 6) << 4)], dim=2)  # sub-blocks 0..3, 4..7
    mins = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=2)
    qs = raw[:, :, 16:].reshape(n, k // 256, 4, 32)  # four 32-byte runs, each two sub-blocks (low, high nibbles)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)
    dd = (d[:, :, None] * scale.float()).reshape(n, k // 32)
    mm = -(dmin[:, :, None] * mins.float()).reshape(n, k // 32)
    return QuantWeight(q.contiguous(), dd.contiguous(), mm.contiguous())

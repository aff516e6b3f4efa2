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


@dataclass
class QuantWeight:
    qs: torch.Tensor  # uint8 [N, K/2] (Q4), int8 [N, K] (Q8) or uint8 [N, K] (U8)
    d: torch.Tensor  # float16 [N, K/32] (float32 for U8)
    m: torch.Tensor | None  # as d; None for Q8

    @property
    def kind(self) -> str:
        if self.m is None:
            return "q8"
        return "u8" if self.qs.shape[1] == self.d.shape[1] * 32 else "q4"

    @property
    def few_token_ok(self) -> bool:
        """The few-token kernels (quant_linear, the compiled decode layers) read Q4 and Q8 only."""
        return self.kind in ("q4", "q8")

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.d.shape[1] * 32

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
        d = self.d.float()[:, :, None]
        if self.m is None:
            return (self.qs.view(n, -1, 32).float() * d).reshape(n, k)
        if self.kind == "u8":
            return (self.qs.view(n, -1, 32).float() * d + self.m.float()[:, :, None]).reshape(n, k)
        q = nibbles(self.qs.reshape(-1, 16)).view(n, -1, 32).float()
        return (q * d + self.m.float()[:, :, None]).reshape(n, k)

    def as_u8(self) -> QuantWeight:
        """The same weights as one unsigned code per weight with a float32 scale and offset per block (exact:
        Q8's q becomes q + 128 with offset -128 d)."""
        if self.kind == "u8":
            return self
        n, k = self.shape
        d = self.d.float()
        if self.m is None:
            return QuantWeight((self.qs.to(torch.int16) + 128).to(torch.uint8), d, d * -128)
        return QuantWeight(nibbles(self.qs.reshape(-1, 16)).reshape(n, k), d, self.m.float())


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

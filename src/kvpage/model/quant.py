"""GGUF block-quantized weights kept as they are, for the few-token steps that are bound by reading weights.

One stream's decode step reads every weight once per token. From bf16 that is 270 MB per token for
SmolLM2-135M; from the file's own Q4_1 / Q8_0 blocks it is ~96 MB. The compiled ``quant_linear`` kernel
computes straight from these blocks in float32 on the exact weights (no bf16 rounding of them); larger
batches keep using the packed bf16 GEMM, which is compute-bound and faster there.

Layout (repacked once at load so the kernel reads aligned, homogeneous rows):
  Q4 (from Q4_0 and Q4_1): ``qs`` uint8 [N, K/2] (GGUF's nibble order), ``d``/``m`` float16 [N, K/32];
      weight = d * q + m (Q4_0's q - 8 becomes m = -8 d, exact in float16).
  Q8 (from Q8_0): ``qs`` int8 [N, K], ``d`` float16 [N, K/32]; weight = d * q.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from kvpage.model.dequant import nibbles

# Steps with at most KernelConfig.quant_max_tokens tokens use the quantized kernels (the measured crossover:
# benchmarks/quant_linear.py); their activations go in as 16-bit integer blocks where the build has that
# kernel (AVX2: one integer product per pair of weights instead of a float conversion and FMA per weight;
# rounding <= 1.5e-5 of each 32-block's largest value), unless KernelConfig.quant_int16 is off.
QUANT_TYPES = {Q.Q4_0, Q.Q4_1, Q.Q8_0}


@dataclass
class QuantWeight:
    qs: torch.Tensor  # uint8 [N, K/2] (Q4) or int8 [N, K] (Q8)
    d: torch.Tensor  # float16 [N, K/32]
    m: torch.Tensor | None  # float16 [N, K/32], Q4 only

    @property
    def kind(self) -> str:
        return "q4" if self.m is not None else "q8"

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
        q = nibbles(self.qs.reshape(-1, 16)).view(n, -1, 32).float()
        return (q * d + self.m.float()[:, :, None]).reshape(n, k)


def concat(parts: list[QuantWeight | None]) -> QuantWeight | None:
    """Row-wise concatenation (fused q|k|v or gate|up); None unless every part is present and of one kind."""
    if not parts or any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
        return None
    if len({p.shape[1] for p in parts}) != 1:
        return None
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return QuantWeight(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte ``at`` of every block: [N, K/32]."""
    return blocks[:, :, at : at + 2].contiguous().view(torch.float16).reshape(blocks.shape[:2])


def from_gguf(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> QuantWeight | None:
    """The repacked blocks of one GGUF matrix ([out, in] in torch order), or None for other formats/shapes."""
    if qtype not in QUANT_TYPES or len(shape) != 2 or shape[1] % 32:
        return None
    n, k = shape
    size = {Q.Q8_0: 34, Q.Q4_1: 20, Q.Q4_0: 18}[qtype]
    blocks = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).reshape(n, k // 32, size)
    d = _half(blocks, 0)
    if qtype == Q.Q8_0:
        return QuantWeight(blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, k), d, None)
    if qtype == Q.Q4_1:
        return QuantWeight(blocks[:, :, 4:].contiguous().reshape(n, k // 2), d, _half(blocks, 2))
    # Q4_0: value = d * (q - 8) = d * q + (-8 d)
    return QuantWeight(blocks[:, :, 2:].contiguous().reshape(n, k // 2), d, (d.float() * -8).half())

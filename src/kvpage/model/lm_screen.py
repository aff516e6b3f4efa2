"""Greedy steps' argmax from a float32 lm head without its whole float32 product (AVX2 builds).

A greedy step needs one token per row, and on float32 machines the head's [rows, hidden] x [hidden, vocab]
product is ~7% of an online run's time (SmolLM2; Gemma 3's 262k-token head is ~60% of a decode row's products).
The screen (ops/csrc/linear/lm_screen.cpp) multiplies 7-bit codes of the hidden rows and 8-bit codes of the
head's rows in integers, bounds each product's distance from the float32 one
exactly (Cauchy-Schwarz on the two roundings, plus float32's own), and multiplies in float32, as the panel GEMM
does, only the tokens whose upper bound reaches the best lower bound: the argmax is the one the whole product
would give, bit for bit. The hidden state's few large channels would make its codes coarse; they are taken out
of the codes and multiplied exactly (``OUTLIER_CHANNELS``, chosen from the first screened step's rows, which only
moves the speed, never the result).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.model.logits import LogitsResult
from kvpage.ops import Kernels

# The hidden state's channels multiplied exactly instead of coded: SmolLM2's final hidden rows have a largest
# |value| ~15x their RMS; with its 32 largest channels out, ~3.6x, and a row has tens to a few hundred candidates
# of 49,152 (docs/model.md).
OUTLIER_CHANNELS = 32
# int32 sums of up to this many products of the codes stay exact (hidden sizes above it keep the whole product)
MAX_HIDDEN = 8192


@dataclass
class LmScreen:
    """A float32 head's codes and bounds' factors (lm_screen_prepare), and its outlier columns once chosen."""

    weight: torch.Tensor
    prepared: list[torch.Tensor]
    outliers: torch.Tensor | None = None
    w_out: torch.Tensor | None = None
    candidates: list[int] = field(default_factory=lambda: [0, 0])  # rows screened, tokens multiplied in float32

    @classmethod
    def build(cls, ops: Kernels, weight: torch.Tensor) -> LmScreen | None:
        """The screen for ``weight`` where this build and configuration take it, else None."""
        if not ops.lm_screen_ok or weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] > MAX_HIDDEN:
            return None
        weight = weight.detach().contiguous()
        return cls(weight, ops.lm_screen_prepare(weight))

    def argmax(self, ops: Kernels, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax (first index on ties), or None where there are no rows or they are not finite (the
        whole product then decides, as it would for NaN or infinite logits)."""
        if hidden.shape[0] == 0 or hidden.dtype != torch.float32 or not bool(torch.isfinite(hidden).all()):
            return None
        if self.outliers is None:
            k = min(OUTLIER_CHANNELS, hidden.shape[1])
            self.outliers = hidden.abs().amax(dim=0).topk(k).indices.sort().values
            self.w_out = ops.f32_pack_weight(self.weight[:, self.outliers].contiguous())
        tokens, candidates = ops.lm_screen_argmax(hidden, self.weight, self.prepared, self.outliers, self.w_out)
        self.candidates[0] += hidden.shape[0]
        self.candidates[1] += int(candidates.sum())
        return tokens


def screened_tokens(screen: LmScreen | None, ops: Kernels, hidden: torch.Tensor,
                    argmax_only: bool) -> LogitsResult | None:
    """A greedy step's tokens from the screen (both fast paths' heads), or None where the whole product runs:
    steps that want logits or draws, builds and heads without a screen, rows that are not finite."""
    if not argmax_only or screen is None:
        return None
    tokens = screen.argmax(ops, hidden)
    return None if tokens is None else LogitsResult(None, tokens, None)

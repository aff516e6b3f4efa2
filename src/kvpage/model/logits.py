"""What a step's lm head returns: float32 logits (or only their argmax), each row's argmax and log-sum-exp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpage.ops import Kernels


@dataclass
class LogitsResult:
    logits: torch.Tensor | None  # [rows, vocab] float32; None when only the argmax was asked for
    argmax: torch.Tensor  # [rows] int64
    lse: torch.Tensor | None  # [rows] float32: log-sum-exp, so logprob(t) = logits[t] - lse


def logits_result(logits: torch.Tensor, argmax: torch.Tensor, lse: torch.Tensor, argmax_only: bool) -> LogitsResult:
    """The kernels' (logits, argmax, lse), with the logits dropped when only the argmax was asked for."""
    return LogitsResult(None, argmax, None) if argmax_only else LogitsResult(logits, argmax, lse)


def postprocess_raw(ops: Kernels, raw: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                    argmax_only: bool, buffer: LogitsBuffer | None) -> LogitsResult:
    """The compiled logits pass over one step's raw lm-head output: bf16 outputs of bf16 weights get their
    near-max entries recomputed exactly from the float32 hidden state; the logits go to ``buffer`` if given."""
    out = None if argmax_only or buffer is None else buffer.view(raw.shape[0], raw.shape[1])
    if raw.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        res = ops.logits_postprocess(raw, hidden.float(), weight, not argmax_only, out)
    else:
        res = ops.logits_postprocess(raw.float(), hidden, weight, not argmax_only, out)
    return logits_result(*res, argmax_only)


class LogitsBuffer:
    """Float32 storage for a step's [rows, vocab] logits, kept from step to step and grown when a step needs
    more. A fresh [256, 262144] float32 tensor each step is a new mapping faulted in page by page (~40 ms on a
    2-core EPYC, more than the logits pass itself). A view it hands out is valid until the next ``view``: the
    engine samples from a step's logits before it runs the next step."""

    def __init__(self) -> None:
        self._storage = torch.empty(0)

    def view(self, rows: int, vocab: int) -> torch.Tensor:
        need = rows * vocab
        if self._storage.numel() < need:
            self._storage = torch.empty(max(need, self._storage.numel() * 5 // 4))
        return self._storage[:need].view(rows, vocab)

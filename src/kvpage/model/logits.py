"""What a step's lm head returns: float32 logits (or only their argmax), each row's argmax and log-sum-exp."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsResult:
    logits: torch.Tensor | None  # [rows, vocab] float32; None when only the argmax was asked for
    argmax: torch.Tensor  # [rows] int64
    lse: torch.Tensor | None  # [rows] float32: log-sum-exp, so logprob(t) = logits[t] - lse


def logits_result(logits: torch.Tensor, argmax: torch.Tensor, lse: torch.Tensor, argmax_only: bool) -> LogitsResult:
    """The kernels' (logits, argmax, lse), with the logits dropped when only the argmax was asked for."""
    return LogitsResult(None, argmax, None) if argmax_only else LogitsResult(logits, argmax, lse)

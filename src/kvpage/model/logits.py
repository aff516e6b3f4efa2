"""What a step's lm head returns: float32 logits (or only their argmax), each row's argmax and log-sum-exp."""

from __future__ import annotations

from collections.abc import Callable
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
    tokens: torch.Tensor | None = None  # [rows, draws] int64 when the logits pass drew them (RowDraws)


@dataclass
class RowDraws:
    """Each logits row's draw, for the logits pass to make while the row is in cache (ops.logits_draw) when
    no request of the step needs the logits themselves: no [rows, vocab] float32 logits are written. The
    settings are sample_rows'; temperature 0 takes the row's argmax."""

    temperature: torch.Tensor  # [rows] float32, 0 = argmax
    top_k: torch.Tensor  # [rows] int64, 0 = off
    top_p: torch.Tensor  # [rows] float32
    min_p: torch.Tensor  # [rows] float32
    uniforms: torch.Tensor  # [rows, draws] float64 in [0, 1)
    mask_of: torch.Tensor | None = None  # [rows] int64: the row's allowed-token mask in ``masks``, -1 = none
    masks: torch.Tensor | None = None  # [masks, words] int32 bit words (bit j of word i: token 32 i + j allowed)

    def run(self, ops: Kernels, parts: list[torch.Tensor], hidden: torch.Tensor,
            weight: torch.Tensor) -> LogitsResult | None:
        """The tokens, or None if the kernel refused the settings: the caller then computes the logits, and
        the sampler's own per-request path reports which request fails (a draw never fails the whole step)."""
        try:
            tokens, argmax = ops.logits_draw(parts, hidden, weight, self.temperature, self.top_k, self.top_p,
                                             self.min_p, self.uniforms, self.mask_of, self.masks)
        except RuntimeError:
            return None
        return LogitsResult(None, argmax, None, tokens)


def logits_result(logits: torch.Tensor, argmax: torch.Tensor, lse: torch.Tensor, argmax_only: bool) -> LogitsResult:
    """The kernels' (logits, argmax, lse), with the logits dropped when only the argmax was asked for."""
    return LogitsResult(None, argmax, None) if argmax_only else LogitsResult(logits, argmax, lse)


def postprocess_raw(ops: Kernels, raw: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                    argmax_only: bool, buffer: LogitsBuffer | None, draws: RowDraws | None = None) -> LogitsResult:
    """The compiled logits pass over one step's raw lm-head output: bf16 outputs of bf16 weights get their
    near-max entries recomputed exactly from the float32 hidden state; the logits go to ``buffer`` if given.
    With ``draws`` each row's token is drawn in the pass and no logits are returned."""
    if raw.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        raw_in, hidden_in = raw, hidden.float()
    else:
        raw_in, hidden_in = raw.float(), hidden
    if draws is not None and not argmax_only:
        res = draws.run(ops, [raw_in], hidden_in, weight)
        if res is not None:
            return res
    out = None if argmax_only or buffer is None else buffer.view(raw.shape[0], raw.shape[1])
    res = ops.logits_postprocess(raw_in, hidden_in, weight, not argmax_only, out)
    return logits_result(*res, argmax_only)


def lm_head_logits(lm_product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                   weight: torch.Tensor, ops: Kernels | None, argmax_only: bool,
                   buffer: LogitsBuffer | None, draws: RowDraws | None = None) -> LogitsResult:
    """float32 logits with each row's argmax and log-sum-exp, for every model's lm head; with ``argmax_only``
    (plain greedy steps) the compiled path returns only the argmax and never writes the [rows, vocab] logits.

    With bf16 weights the product's output is rounded to 8 mantissa bits (~0.06 at a logit of 15), enough to
    flip near-ties; entries within that rounding distance of each row's maximum are recomputed exactly in
    float32 from the float32 hidden state (compiled: postprocess_raw; here in torch), so greedy choices and
    top logprobs do not depend on it.
    """
    raw = lm_product(hidden.to(weight.dtype), weight)
    if raw.shape[0] == 0:
        return LogitsResult(raw.float(), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    if ops is not None:
        return postprocess_raw(ops, raw, hidden, weight, argmax_only, buffer, draws)
    logits = raw.float()
    if weight.dtype != torch.float32:
        top = logits.max(dim=-1, keepdim=True).values
        rows, cols = (logits >= top - top.abs() / 32 - 1e-3).nonzero(as_tuple=True)
        logits[rows, cols] = (hidden[rows].float() * weight[cols].float()).sum(dim=-1)
    return LogitsResult(logits, logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1))


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

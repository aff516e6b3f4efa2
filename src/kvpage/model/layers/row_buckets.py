"""Row counts for the products kvpage hands to oneDNN.

Why: oneDNN builds a primitive for every distinct shape a product meets (on the AMX Xeon, 2026-12-06: 1-14 ms the
first time at 7-1,500 rows of a [1536 x 576] bf16 weight, against 0.1-3 ms once cached) and keeps it in two caches
of 1,024 entries each (its own and ideep's), about a MiB apiece. A server's steps take every row count from 1 to the
token budget, so a tensor-parallel server (whose ranks multiply on oneDNN) grew by ~75 MiB a minute per rank
(600 s of `benchmarks/soak.py`: +775 MiB on rank 0) and compiled primitives on most steps. Products that go to
oneDNN therefore take their rows in a few sizes only (row_bucket), zero-padded up to the next.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 16  # the smallest call: fewer rows are padded (a product this small is bound by its weight's bytes)


def row_bucket(rows: int) -> int:
    """The row count a call of ``rows`` rows is padded to: the next of 16, 24, 32, 48, 64, 96, ... (powers of two
    and one and a half times them; at most 1.5x the rows, nineteen shapes up to 8K). One padded call, not
    chunks of powers of two: with their primitives cached, four weights of SmolLM2's shapes at 2,000 rows took
    1.10x one exact call padded to 2,048 and 1.55x cut into 1,024 + 512 + 256 + 256 (AMX Xeon, 2026-12-06)."""
    bucket = MIN_ROWS
    while bucket < rows:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket // 3 * 4
    return bucket


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) with its rows zero-padded to row_bucket's count; ``x`` itself when it has that many (or none)."""
    rows = x.shape[0]
    bucket = row_bucket(rows)
    if rows == 0 or bucket == rows:
        return x
    padded = x.new_empty((bucket, x.shape[1]))
    padded[:rows] = x
    padded[rows:].zero_()
    return padded


def by_row_buckets(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` for a product that treats rows independently (a linear layer), called only with row counts
    row_bucket gives (zero rows pad below). Leading dimensions beyond the last are flattened into rows."""
    if x.dim() != 2:
        lead = x.shape[:-1]
        out = by_row_buckets(x.reshape(-1, x.shape[-1]), product)
        return out.reshape(*lead, out.shape[-1])
    padded = padded_rows(x)
    return product(padded) if padded is x else product(padded)[: x.shape[0]]


def bucketed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` in row_bucket's sizes (a model's lm_product on the plain path)."""
    return by_row_buckets(x, lambda rows: F.linear(rows, weight))


class RowBucketedLinear(nn.Linear):
    """An nn.Linear whose product runs in row_bucket's sizes (the plain path's bf16 layers go to oneDNN); the
    same parameters and attributes as the layer it replaces."""

    @classmethod
    def of(cls, linear: nn.Linear) -> RowBucketedLinear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return by_row_buckets(x, lambda rows: F.linear(rows, self.weight, self.bias))


def bucket_linears(net: nn.Module) -> int:
    """Every plain nn.Linear under ``net`` replaced by a RowBucketedLinear (in place); returns how many."""
    n = 0
    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, RowBucketedLinear.of(child))
                n += 1
    return n

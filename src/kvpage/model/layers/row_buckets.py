"""Row counts for the products kvpage hands to oneDNN.

Why: oneDNN builds a primitive for every distinct shape a product meets (on the AMX Xeon, 2026-12-06: 1-14 ms the
first time at 7-1,500 rows of a [1536 x 576] bf16 weight, against 0.1-3 ms once cached) and keeps it in two caches
of 1,024 entries each (its own and ideep's), 1-2 MiB apiece. A server's steps take every row count from 1 to the
token budget, so a tensor-parallel server (whose ranks multiply on oneDNN) grew by ~75 MiB a minute per rank
(600 s of `benchmarks/soak.py`: +775 MiB on rank 0) and compiled primitives on most steps. Products that go to
oneDNN therefore take their rows in a few sizes only: powers of two from MIN_ROWS up, a large call cut into such
chunks (row views, no copy) and a small remainder zero-padded to the next size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 16  # the smallest call: fewer rows are padded (a product this small is bound by its weight's bytes)
SPLIT_ABOVE = 256  # up to this many rows one padded call (at most 2x the rows); above, chunks of powers of two


def row_chunks(rows: int) -> list[tuple[int, int]]:
    """(first row, call rows) covering ``rows`` rows: every call a power of two >= MIN_ROWS; only the last may
    reach past ``rows`` (its extra rows are padding)."""
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < rows:
        left = rows - start
        if left <= SPLIT_ABOVE:
            size = max(MIN_ROWS, 1 << (left - 1).bit_length())  # the next power of two, one padded call
        else:
            size = 1 << (left.bit_length() - 1)  # the largest power of two that fits: a view
        chunks.append((start, size))
        start += size
    return chunks


def by_row_buckets(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` for a product that treats rows independently (a linear layer), called only with row counts
    from row_chunks. Leading dimensions beyond the last are flattened into rows and restored."""
    if x.dim() != 2:
        lead = x.shape[:-1]
        out = by_row_buckets(x.reshape(-1, x.shape[-1]), product)
        return out.reshape(*lead, out.shape[-1])
    rows = x.shape[0]
    chunks = row_chunks(rows)
    if not chunks or (len(chunks) == 1 and chunks[0][1] == rows):  # no rows (no primitive), or a bucket's count
        return product(x)
    parts = []
    for start, size in chunks:
        end = min(rows, start + size)
        if end - start == size:
            parts.append(product(x[start:end]))
            continue
        padded = x.new_zeros((size, x.shape[1]))
        padded[: end - start] = x[start:end]
        parts.append(product(padded)[: end - start])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def bucketed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` in row_chunks' sizes (a model's lm_product on the plain path)."""
    return by_row_buckets(x, lambda rows: F.linear(rows, weight))


class RowBucketedLinear(nn.Linear):
    """An nn.Linear whose product runs in row_chunks' sizes (the plain path's bf16 layers go to oneDNN); the
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

"""The row counts kvpage hands oneDNN: few, covering, and the same products as one call."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvpage.model.layers.linear import PackedLinear
from kvpage.model.layers.row_buckets import (
    MIN_ROWS,
    RowBucketedLinear,
    bucket_linears,
    by_row_buckets,
    row_chunks,
)


@given(st.integers(1, 20_000))
def test_chunks_cover_the_rows_in_powers_of_two(rows):
    chunks = row_chunks(rows)
    assert chunks[0][0] == 0
    for (start, size), (nxt, _) in itertools.pairwise(chunks):
        assert nxt == start + size  # back to back
    start, size = chunks[-1]
    assert start < rows <= start + size
    assert all(size >= MIN_ROWS and size & (size - 1) == 0 for _, size in chunks)
    padded = start + size - rows
    assert padded < max(MIN_ROWS, rows)  # a padded call at most doubles its own rows


def test_a_servers_row_counts_reach_few_shapes():
    sizes = {size for rows in range(1, 8193) for _, size in row_chunks(rows)}
    assert sizes == {2**k for k in range(4, 14)}  # 16 ... 8,192: ten shapes for every row count up to 8K


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 700), st.sampled_from([(3, 5), (2, 3, 5)]))
def test_bucketed_product_equals_one_call(rows, shape):
    torch.manual_seed(rows)
    x = torch.randn(rows, *shape[1:], dtype=torch.float64)
    w = torch.randn(7, shape[-1], dtype=torch.float64)
    seen = []

    def product(a):
        seen.append(a.shape[0])
        return F.linear(a, w)

    got = by_row_buckets(x, product)
    assert got.shape == (rows, *shape[1:-1], 7)
    torch.testing.assert_close(got, F.linear(x, w))
    assert set(seen) <= {size for _, size in row_chunks(x.numel() // shape[-1])} | {0}


def test_plain_path_linears_keep_their_parameters():
    net = nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 2, bias=False)))
    before = [p.data_ptr() for p in net.parameters()]
    assert bucket_linears(net) == 2
    assert all(type(m) is RowBucketedLinear for m in (net[0], net[1][0]))
    assert [p.data_ptr() for p in net.parameters()] == before
    x = torch.randn(37, 4)
    torch.testing.assert_close(net(x), F.linear(F.linear(x, net[0].weight, net[0].bias), net[1][0].weight))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN")
def test_packed_linears_onednn_path_takes_bucketed_rows(monkeypatch):
    """PackedLinear without compiled kernels multiplies on oneDNN: only row_chunks' sizes reach it."""
    w = torch.randn(64, 32).to(torch.bfloat16)
    lin = PackedLinear(w, None, ops=None)
    assert lin.packed is not None
    seen = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        @staticmethod
        def _linear_pointwise(x, *a):
            seen.append(x.shape[0])
            return real(x, *a)

    monkeypatch.setattr(torch.ops, "mkldnn", Spy)
    for rows in (1, 5, 17, 300, 1000):
        x = torch.randn(rows, 32).to(torch.bfloat16)
        assert lin(x).shape == (rows, 64)
    assert set(seen) <= {16, 32, 512, 256, 128, 64} and 5 not in seen and 1000 not in seen


def test_plain_bf16_model_multiplies_in_buckets(smol_fp32):
    """The plain path at bf16 (what tensor-parallel ranks run) buckets every projection and its lm head; float32
    (MKL, no primitive per shape) stays as transformers computes it."""
    from kvpage.model.layers.row_buckets import bucketed_product
    from kvpage.model.loader import load_model

    plain = load_model(dtype="bfloat16", fast=False).model
    assert plain.lm_product is bucketed_product
    kinds = {type(m) for m in plain.modules() if isinstance(m, nn.Linear)}
    assert kinds == {RowBucketedLinear}
    assert not any(type(m) is RowBucketedLinear for m in smol_fp32.model.modules())

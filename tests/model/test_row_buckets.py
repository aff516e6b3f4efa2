"""The row counts kvpage hands oneDNN: few, covering, and the same products as one call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvpage.model.layers.linear import PackedLinear, packing_available
from kvpage.model.layers.row_buckets import (
    MIN_ROWS,
    RowBucketedLinear,
    bucket_linears,
    by_row_buckets,
    row_bucket,
)


@given(st.integers(1, 20_000))
def test_a_bucket_holds_the_rows_with_at_most_half_again(rows):
    bucket = row_bucket(rows)
    assert bucket >= max(rows, MIN_ROWS)
    assert bucket < max(MIN_ROWS + 1, 1.5 * rows + 1)
    assert row_bucket(bucket) == bucket


def test_a_servers_row_counts_reach_few_shapes():
    sizes = {row_bucket(rows) for rows in range(1, 8193)}
    assert sizes == {16 * 2**k for k in range(10)} | {24 * 2**k for k in range(9)}  # nineteen, up to 8K


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
    flat = x.numel() // shape[-1]  # rows after the leading dimensions are flattened
    assert seen == [row_bucket(flat) if flat else 0]


def test_plain_path_linears_keep_their_parameters():
    net = nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 2, bias=False)))
    before = [p.data_ptr() for p in net.parameters()]
    assert bucket_linears(net) == 2
    assert all(type(m) is RowBucketedLinear for m in (net[0], net[1][0]))
    assert [p.data_ptr() for p in net.parameters()] == before
    x = torch.randn(37, 4)
    torch.testing.assert_close(net(x), F.linear(F.linear(x, net[0].weight, net[0].bias), net[1][0].weight))


@pytest.mark.skipif(not packing_available(), reason="no bf16 oneDNN packing on this CPU (it needs AVX-512)")
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
    assert seen == [16, 16, 24, 384, 1024]


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

"""kvpage's float32 panel GEMM (ops/csrc/linear/gemm_f32.cpp), the float32 fast path's projections on AVX2 builds: it
computes x . W^T (+ bias) in float32 for any row count, width and depth, and refuses mismatched operands."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.ops import load_kernels
from tests.helpers.kernels import have_cxx

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


@pytest.fixture(scope="module")
def ops():
    ops = load_kernels()
    if ops is None or not ops.f32_gemm_available():
        pytest.skip("f32_linear is built for AVX2 + FMA CPUs without AVX-512 only")
    return ops


def check(ops, m: int, n: int, k: int, bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = ops.f32_pack_weight(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    got = ops.f32_linear(x, packed, n, b)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # one float32 sum per output in k order: within a few ulps of sqrt(k)-scaled magnitudes
    tol = 1e-5 * (x.abs().double() @ w.abs().double().t()) + 1e-6
    assert bool(((got.double() - exact).abs() <= tol).all()), float((got.double() - exact).abs().max())


@pytest.mark.parametrize("n,k", [(16, 64), (40, 64), (33, 130), (1, 1), (48, 576), (17, 1)])
def test_pack_lays_out_panels_of_w_transposed_with_zero_columns_past_n(ops, n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 1000 + k))
    p = (n + 15) // 16
    expected = torch.zeros(p * 16, k)
    expected[:n] = w
    expected = expected.view(p, 16, k).transpose(1, 2)  # panel q, k, column j = W[16q + j, k]
    assert torch.equal(ops.f32_pack_weight(w), expected)
    assert torch.equal(ops.f32_pack_weight(w.t().contiguous().t()), expected)  # a transposed view packs alike


@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 128, 131, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (50, 33), (16, 1536), (17, 8)])
def test_f32_linear_matches_float64(ops, m, n, k):
    check(ops, m, n, k, bias=(m % 2 == 1), seed=m * 1000 + n + k)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 200), n=st.integers(1, 100), k=st.integers(1, 700), bias=st.booleans())
def test_f32_linear_any_shape(ops, m, n, k, bias):
    check(ops, m, n, k, bias, seed=m + 7 * n + 13 * k)


def test_f32_linear_rows_do_not_depend_on_the_batch(ops):
    """A row's result does not depend on the rows around it (how the call cuts them into chunks and tiles):
    each output is one float32 sum in k order, so a sequence's numbers are the same alone or in a batch."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(260, 576, generator=g), torch.randn(100, 576, generator=g)
    packed = ops.f32_pack_weight(w)
    whole = ops.f32_linear(x, packed, 100)
    parts = torch.cat([ops.f32_linear(x[i : i + 6], packed, 100) for i in range(0, 260, 6)])
    assert torch.equal(whole, parts)


def test_f32_linear_is_the_same_on_any_number_of_threads(ops):
    """The threads claim (row chunk, panel) tasks as they go, so which thread computes an output changes from
    call to call; every output is one task's, so its bits do not: 1 thread, 2 threads and repeated calls agree
    on many row chunks (1,000 rows of 1,536 features: 24 chunks) and on a short, wide product."""
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    for m, n, k in ((1000, 200, 1536), (7, 4100, 64)):
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        packed = ops.f32_pack_weight(w)
        try:
            torch.set_num_threads(1)
            one = ops.f32_linear(x, packed, n, b)
            torch.set_num_threads(2)
            runs = [ops.f32_linear(x, packed, n, b) for _ in range(3)]
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(one, r) for r in runs)
        check(ops, m, n, k, bias=True, seed=m + n)


def test_f32_linear_rejects_mismatched_operands(ops):
    packed = ops.f32_pack_weight(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="features"):
        ops.f32_linear(torch.randn(3, 65), packed, 40)
    with pytest.raises(RuntimeError, match="panels"):
        ops.f32_linear(torch.randn(3, 64), packed, 60)
    with pytest.raises(RuntimeError, match="bias"):
        ops.f32_linear(torch.randn(3, 64), packed, 40, torch.zeros(39))
    with pytest.raises(RuntimeError, match="float32"):
        ops.f32_linear(torch.randn(3, 64).bfloat16(), packed, 40)

"""kvpage's bf16 panel GEMM (ops/csrc/linear/gemm_bf16.cpp), the bf16 layer projections of many-row steps on
AVX512_BF16 CPUs without AMX: x . W^T (+ bias) as one float32 sum per output rounded once to bf16, for any row
count; a row's bits do not depend on the rows around it or on the threads; the gated MLP product's epilogue gives
the bits of silu_mul / gelu_mul after the plain product; bad operands are refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.envs import KernelConfig
from kvpage.model.layers.linear import PackedLinear
from kvpage.ops import ACT_GELU_TANH, ACT_SILU, kernels, load_kernels
from tests.helpers.kernels import have_cxx

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


@pytest.fixture(scope="module")
def ops():
    ops = load_kernels()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("bf16_linear is built for AVX512_BF16 CPUs only")
    return ops


def check(ops, m: int, n: int, k: int, bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    packed = ops.bf16_pack_weight(w)
    assert packed.shape == (n // 16, k // 2, 16, 2)
    got = ops.bf16_linear(x, packed, n, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    # a float32 sum (products of bf16 pairs are exact in float32) rounded once to bf16: half a bf16 ulp of the
    # result plus the float32 sum's rounding over k terms
    mag = x.abs().double() @ w.abs().double().t() + (b.abs().double() if bias else 0)
    tol = 2.0**-8 * exact.abs() + 1e-6 * k * mag + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= tol).all()), float((err - tol).max())


@pytest.mark.parametrize("m", [1, 3, 4, 8, 9, 64, 128, 131, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (32, 64), (16, 2)])
def test_bf16_linear_matches_float64(ops, m, n, k):
    check(ops, m, n, k, bias=(m % 2 == 1), seed=m * 1000 + n + k)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 200), panels=st.integers(1, 8), pairs=st.integers(1, 400), bias=st.booleans())
def test_bf16_linear_any_shape(ops, m, panels, pairs, bias):
    check(ops, m, 16 * panels, 2 * pairs, bias, seed=m + 7 * panels + 13 * pairs)


def test_bf16_linear_is_close_to_onednn(ops):
    """Against torch's bf16 linear (oneDNN) on SmolLM2's q|k|v shape: the same sums up to their order, so the
    outputs differ by at most one bf16 rounding step of either."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 576, generator=g).to(torch.bfloat16)
    w = (torch.randn(960, 576, generator=g) * 0.05).to(torch.bfloat16)
    got = ops.bf16_linear(x, ops.bf16_pack_weight(w), 960, None).float()
    ref = torch.nn.functional.linear(x, w).float()
    assert bool(((got - ref).abs() <= 2.0**-7 * ref.abs() + 1e-3).all())


def test_bf16_linear_rows_do_not_depend_on_the_batch(ops):
    """Every register tile (8, 4 or 1 rows) sums a row's k pairs in the same order, so a row's bits are the same
    alone or in any batch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(261, 576, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 576, generator=g).to(torch.bfloat16)
    packed = ops.bf16_pack_weight(w)
    whole = ops.bf16_linear(x, packed, 96, None)
    assert torch.equal(whole, torch.cat([ops.bf16_linear(x[i : i + 5], packed, 96, None) for i in range(0, 261, 5)]))
    assert torch.equal(whole[7:8], ops.bf16_linear(x[7:8], packed, 96, None))


def test_bf16_linear_is_the_same_on_any_number_of_threads(ops):
    """Threads claim (row chunk, panel triple) tasks as they go; each output is one task's, so its bits do not
    depend on which thread computed it: many row chunks (1,000 rows of 1,536 features) and a short, wide product."""
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    for m, n, k in ((1000, 208, 1536), (7, 4096, 64)):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w, b = torch.randn(n, k, generator=g).to(torch.bfloat16), torch.randn(n, generator=g)
        packed = ops.bf16_pack_weight(w)
        try:
            torch.set_num_threads(1)
            one = ops.bf16_linear(x, packed, n, b)
            torch.set_num_threads(2)
            runs = [ops.bf16_linear(x, packed, n, b) for _ in range(3)]
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(one, r) for r in runs)


@pytest.mark.parametrize("m", [1, 4, 5, 6, 7, 12, 13, 131, 300])
@pytest.mark.parametrize("n,k", [(3072, 576), (96, 64), (32, 40)])
@pytest.mark.parametrize("act", [ACT_SILU, ACT_GELU_TANH])
def test_bf16_linear_gated_is_the_product_then_its_activation(ops, m, n, k, act):
    """A gated packing ([gate; up], panels interleaved) with act: act(gate) * up in the epilogue, [m, n / 2], to
    the bit what the plain product followed by silu_mul / gelu_mul gives (the engine's steps may take either)."""
    g = torch.Generator().manual_seed(m * 31 + n + act)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    plain = ops.bf16_linear(x, ops.bf16_pack_weight(w), n, None)
    want = ops.silu_mul(plain) if act == ACT_SILU else ops.gelu_mul(plain)
    got = ops.bf16_linear(x, ops.bf16_pack_weight(w, True), n, None, act)
    assert got.shape == (m, n // 2) and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bf16_linear_refuses_bad_operands(ops):
    w = torch.randn(32, 64).to(torch.bfloat16)
    packed = ops.bf16_pack_weight(w)
    with pytest.raises(RuntimeError, match="out_features % 16"):
        ops.bf16_pack_weight(torch.randn(20, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        ops.bf16_pack_weight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="features"):
        ops.bf16_linear(torch.randn(4, 62).to(torch.bfloat16), packed, 32, None)
    with pytest.raises(RuntimeError, match="panels"):
        ops.bf16_linear(torch.randn(4, 64).to(torch.bfloat16), packed, 48, None)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        ops.bf16_linear(torch.randn(4, 64), packed, 32, None)
    with pytest.raises(RuntimeError, match="out_features % 32"):
        ops.bf16_pack_weight(torch.randn(48, 64).to(torch.bfloat16), True)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="takes no bias"):
        ops.bf16_linear(x, ops.bf16_pack_weight(w, True), 32, torch.zeros(32), ACT_SILU)
    with pytest.raises(RuntimeError, match="N % 32"):
        ops.bf16_linear(x, ops.bf16_pack_weight(torch.randn(48, 64).to(torch.bfloat16)), 48, None, ACT_SILU)
    with pytest.raises(RuntimeError, match="act must be"):
        ops.bf16_linear(x, packed, 32, None, 3)


def test_packed_linear_takes_it_above_the_int8_rows(ops):
    """A bf16 projection on these CPUs runs the panel GEMM for every row count above what the int8 GEMM takes
    (here: no int8 GEMM, so every row count above the quantized blocks' few), and oneDNN with the switch off;
    a gated one applies its activation after it; an lm head takes it by vocabulary slices."""
    k = kernels(KernelConfig(i8_gemm="0", bf16_gemm="1"))
    if not k.bf16_gemm_ok:
        pytest.skip("AMX CPUs run bf16 projections on the tile GEMM")
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(192, 128, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(40, 128, generator=g).to(torch.bfloat16)
    lin = PackedLinear(w, None, ops=k)
    assert lin.bf16 is not None and lin.packed is None
    assert torch.equal(lin(x), k.bf16_linear(x, lin.bf16, 192, None))
    plain = k.bf16_linear(x, k.bf16_pack_weight(w), 192, None)
    gated = PackedLinear(w, None, ops=k, gated=True)
    assert gated.bf16_act == ACT_SILU  # the activation in the GEMM's epilogue, the bits of silu_mul after it
    assert torch.equal(gated(x), k.silu_mul(plain))
    gelu = PackedLinear(w, None, ops=k, gated=True, activation="gelu_tanh")
    assert torch.equal(gelu(x), k.gelu_mul(plain))
    off = PackedLinear(w, None, ops=kernels(KernelConfig(i8_gemm="0", bf16_gemm="0")))
    assert off.bf16 is None and off.packed is not None
    # lm heads take it by vocabulary slices of whole panels (views of the packing): the same bits as one product
    head = PackedLinear(w, None, ops=k, split_rows=64)
    assert head.bf16 is not None and head.packed is None and not head.packed_parts
    assert head.splits(x.shape[0])
    parts = list(head.forward_parts(x))
    assert [start for start, _ in parts] == [0, 64, 128] and all(p.shape == (x.shape[0], 64) for _, p in parts)
    assert torch.equal(torch.cat([p for _, p in parts], dim=1), plain)
    odd = PackedLinear(w, None, ops=k, split_rows=40)  # not whole panels: oneDNN's slices
    assert odd.bf16 is None and odd.packed_parts

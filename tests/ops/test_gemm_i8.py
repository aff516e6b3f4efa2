"""The int8 GEMM on the checkpoint's quantized blocks (ops/csrc/linear/gemm_i8.cpp), bf16 models' many-row
projections on AVX-512 VNNI CPUs without AMX: x . W^T on the exact Q4 / Q8 weights with activations rounded to
two bytes per value (~16 bits per 32-block), for any row count and width, gated or not, and refusing
mismatched operands."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.model.quant import QuantWeight
from kvpage.ops import load_kernels
from tests.helpers.kernels import have_cxx

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


@pytest.fixture(scope="module")
def ops():
    ops = load_kernels()
    if ops is None or not ops.i8_gemm_available():
        pytest.skip("i8_linear is built for AVX-512 VNNI CPUs only")
    return ops


def quant_weight(kind: str, n: int, k: int, g: torch.Generator) -> QuantWeight:
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    if kind == "q8":
        return QuantWeight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d, None)
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half()
    return QuantWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, m)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What two-byte activation codes may cost per output: each value within 1/512 of its 32-block's step
    (absmax / 127), times |w|, plus float32 summation."""
    m, k = x.shape
    step = x.double().abs().view(m, k // 32, 32).amax(-1, keepdim=True) / 127
    per_value = (step / 256).expand(m, k // 32, 32).reshape(m, k)
    return per_value @ w.abs().t() + 1e-6 * (x.double().abs() @ w.abs().t()) + 1e-6


def check(ops, kind: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int,
          gated: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    qw = quant_weight(kind, n, k, g)
    x = (torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4).to(dtype)  # uneven channels
    b = torch.randn(n, generator=g) if bias else None
    codes, scales = ops.i8_pack_weight(qw.qs, qw.d, qw.m, gated)
    p = (n + 15) // 16
    assert codes.shape == (p, k // 32, 512) and scales.shape == (p, k // 32, 32)
    got = ops.i8_linear(x, codes, scales, n, gated, b)
    w = qw.dequantize().double()
    exact = x.double() @ w.t() + (b.double() if bias else 0)
    tol = bound(x, w)
    if gated:
        half = n // 2
        gate, up = exact[:, :half], exact[:, half:]
        exact = torch.nn.functional.silu(gate) * up
        # silu(g) u moves by at most ~1.1 |u| dg + |silu(g)| du
        tol = 1.1 * up.abs() * tol[:, :half] + gate.abs() * tol[:, half:] + 1e-4 * exact.abs() + 1e-5
    assert got.shape == exact.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        tol = tol + exact.abs() * 2.0**-8  # the bf16 output's own rounding
    err = (got.double() - exact).abs()
    assert bool((err <= tol).all()), (float(err.max()), float((err - tol).max()))


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 64, 131])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (40, 64), (16, 32), (48, 96)])
def test_i8_linear_matches_the_exact_product(ops, kind, m, n, k):
    check(ops, kind, m, n, k, torch.float32, bias=(m % 2 == 1), seed=m * 1000 + n + k)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("m", [1, 6, 19])
def test_i8_linear_bf16_rows(ops, kind, m):
    check(ops, kind, m, 96, 576, torch.bfloat16, bias=False, seed=m)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_i8_linear_gated_epilogue(ops, kind, dtype):
    """[gate; up] packed panel-paired: the kernel returns silu(x Wg^T) * (x Wu^T)."""
    for m in (1, 7, 40):
        check(ops, kind, m, 128, 576, dtype, bias=False, seed=m + 5, gated=True)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(0, 90), n=st.integers(1, 80), kb=st.integers(1, 20), kind=st.sampled_from(["q4", "q8"]),
       bias=st.booleans())
def test_i8_linear_any_shape(ops, m, n, kb, kind, bias):
    check(ops, kind, m, n, 32 * kb, torch.float32, bias, seed=m + 7 * n + 13 * kb)


def test_i8_linear_zero_rows_and_blocks(ops):
    """An all-zero block (scale 0) contributes nothing; an all-zero row gives the bias."""
    g = torch.Generator().manual_seed(1)
    qw = quant_weight("q4", 32, 128, g)
    codes, scales = ops.i8_pack_weight(qw.qs, qw.d, qw.m, False)
    x = torch.randn(3, 128, generator=g)
    x[0] = 0
    x[1, 32:64] = 0
    b = torch.randn(32, generator=g)
    got = ops.i8_linear(x, codes, scales, 32, False, b)
    assert torch.equal(got[0], b)
    exact = x.double() @ qw.dequantize().double().t() + b.double()
    assert torch.allclose(got.double(), exact, rtol=1e-4, atol=1e-4)


def test_i8_linear_rows_do_not_depend_on_the_batch(ops):
    """A row's result does not depend on the rows around it (chunks, tiles, threads): each row is quantized on
    its own and summed block by block in one order, so a sequence's numbers are the same alone or in a batch."""
    g = torch.Generator().manual_seed(3)
    qw = quant_weight("q4", 100, 576, g)
    codes, scales = ops.i8_pack_weight(qw.qs, qw.d, qw.m, False)
    x = torch.randn(260, 576, generator=g).bfloat16()
    whole = ops.i8_linear(x, codes, scales, 100, False, None)
    parts = torch.cat([ops.i8_linear(x[i : i + 5], codes, scales, 100, False, None) for i in range(0, 260, 5)])
    assert torch.equal(whole, parts)


def test_i8_linear_rejects_mismatched_operands(ops):
    g = torch.Generator().manual_seed(0)
    qw = quant_weight("q4", 40, 64, g)
    codes, scales = ops.i8_pack_weight(qw.qs, qw.d, qw.m, False)
    with pytest.raises(RuntimeError, match="features"):
        ops.i8_linear(torch.randn(3, 96), codes, scales, 40, False, None)
    with pytest.raises(RuntimeError, match="panels"):
        ops.i8_linear(torch.randn(3, 64), codes, scales, 60, False, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.i8_linear(torch.randn(3, 64), codes, scales, 40, False, torch.zeros(39))
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        ops.i8_linear(torch.randn(3, 64).half(), codes, scales, 40, False, None)
    with pytest.raises(RuntimeError, match="gated"):
        ops.i8_linear(torch.randn(3, 64), codes, scales, 40, True, None)
    with pytest.raises(RuntimeError, match="gated weight"):
        ops.i8_pack_weight(qw.qs, qw.d, qw.m, True)  # 40 rows: not a multiple of 32
    with pytest.raises(RuntimeError, match="i8_pack_weight"):
        ops.i8_linear(torch.randn(3, 64), codes[:, :, :256], scales, 40, False, None)


@pytest.mark.parametrize("n", [16, 48, 100, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_i8_linear_streamed_output_is_the_same_bits(ops, n, dtype):
    """stream=True (an lm head's logits, non-temporal stores) writes the same values as plain stores: odd
    panel counts, a width off the 16-column grid (its tail panel stays on plain stores), with and without a
    bias, bf16 and float32 outputs; a gated product ignores it."""
    g = torch.Generator().manual_seed(n)
    qw = quant_weight("q4", n, 256, g)
    codes, scales = ops.i8_pack_weight(qw.qs, qw.d, qw.m, False)
    x, b = torch.randn(37, 256, generator=g).to(dtype), torch.randn(n, generator=g)
    for bias in (None, b):
        assert torch.equal(ops.i8_linear(x, codes, scales, n, False, bias, True),
                           ops.i8_linear(x, codes, scales, n, False, bias))
    if n % 32 == 0:
        gc, gs = ops.i8_pack_weight(qw.qs, qw.d, qw.m, True)
        assert torch.equal(ops.i8_linear(x, gc, gs, n, True, None, True), ops.i8_linear(x, gc, gs, n, True, None))


@pytest.mark.parametrize("gated", [False, True])
def test_packed_linear_takes_the_int8_gemm_up_to_its_row_limit(ops, gated):
    """Where the int8 GEMM pays only for a few rows (the Zen 4 EPYC: ops/kernels.py int8_gemm_rows), a layer keeps
    both packings and each call takes the int8 GEMM up to the limit, oneDNN's bf16 GEMM above it: each the same
    bits as that product alone; a head split in vocabulary slices runs whole on the int8 GEMM."""
    from kvpage.envs import KernelConfig
    from kvpage.model.layers.linear import PackedLinear
    from kvpage.ops import Kernels

    bound_ops = Kernels(ops, KernelConfig(i8_gemm="1", amx_linear=False, bf16_gemm="0", quant_max_tokens=0))
    bound_ops.i8_max_rows = 8  # a fresh object, not the shared one kernels() caches
    g = torch.Generator().manual_seed(5)
    qw = quant_weight("q4", 64, 96, g)
    w = qw.dequantize().bfloat16()
    lin = PackedLinear(w, None, qw, bound_ops, gated=gated)
    assert lin.i8 is not None and lin.packed is not None and lin.i8_max_rows == 8
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        got = lin(x)
        if rows <= 8:
            want = ops.i8_linear(x, lin.i8[0], lin.i8[1], 64, gated, None, False)
        else:
            want = torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")
            want = ops.silu_mul(want) if gated else want
        assert torch.equal(got, want), rows
    if gated:
        return
    head = PackedLinear(w, None, qw, bound_ops, split_rows=32)
    assert head.packed is None and len(head.packed_parts) == 2
    assert not head.splits(8) and head.splits(9)
    x = torch.randn(8, 96, generator=g).bfloat16()
    parts = list(head.forward_parts(x))
    assert len(parts) == 1 and torch.equal(parts[0][1], lin(x))
    # where it pays at every row count (Intel), no oneDNN copy of the weight is kept
    everywhere = Kernels(ops, KernelConfig(i8_gemm="1", amx_linear=False, quant_max_tokens=0))
    assert everywhere.i8_max_rows > 1 << 40 and PackedLinear(w, None, qw, everywhere).packed is None

"""The greedy lm-head screen (ops/csrc/linear/lm_screen.cpp, model/lm_screen.py): each row's argmax is the one
the float32 panel GEMM's logits give, bit for bit and first index on ties, whatever the rows hold (channels far
larger than the rest, inside or outside the exactly multiplied ones, ties, near-ties, zeros) and however many."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.envs import KernelConfig
from kvpage.model.lm_screen import MAX_HIDDEN, OUTLIER_CHANNELS, LmScreen
from kvpage.ops import kernels
from tests.helpers.kernels import have_cxx

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


@pytest.fixture(scope="module")
def ops():
    ops = kernels(KernelConfig())
    if ops is None or not ops.lm_screen_ok:
        pytest.skip("the screen runs where f32_linear does: AVX2 + FMA builds without AVX-512")
    return ops


def reference(ops, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the whole product gives: f32_linear's logits, their first maximum."""
    return ops.f32_linear(hidden, ops.f32_pack_weight(weight), weight.shape[0], None).argmax(dim=1)


def screened(ops, hidden: torch.Tensor, weight: torch.Tensor, outliers: torch.Tensor | None = None):
    screen = LmScreen.build(ops, weight)
    assert screen is not None
    if outliers is not None:
        screen.outliers = outliers
        screen.w_out = ops.f32_pack_weight(weight[:, outliers].contiguous())
    return screen, screen.argmax(ops, hidden)


def heavy_rows(m: int, k: int, g: torch.Generator, scale: float = 30.0) -> torch.Tensor:
    """Rows like a final hidden state: most channels small, a few fixed ones an order of magnitude larger."""
    h = torch.randn(m, k, generator=g)
    h[:, torch.arange(0, k, max(1, k // 7))] *= scale
    return h


@pytest.mark.parametrize("m", [1, 2, 5, 7, 128])
@pytest.mark.parametrize("n,k", [(2000, 576), (1001, 64), (333, 100), (97, 1024)])
def test_argmax_is_the_panel_gemms(ops, m, n, k):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    weight = torch.randn(n, k, generator=g) * 0.05
    hidden = heavy_rows(m, k, g)
    screen, tokens = screened(ops, hidden, weight)
    assert torch.equal(tokens, reference(ops, hidden, weight))
    assert screen.outliers is not None and screen.outliers.numel() == min(OUTLIER_CHANNELS, k)
    assert screen.candidates[0] == m and m <= screen.candidates[1] <= m * n


def test_later_rows_with_other_large_channels(ops):
    """The outlier channels come from the first screened rows; rows whose large channels are elsewhere get looser
    bounds (more tokens multiplied exactly), never another answer."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(3000, 576, generator=g) * 0.05
    rows = heavy_rows(4, 576, g)
    screen, first = screened(ops, rows, weight)
    assert torch.equal(first, reference(ops, rows, weight))
    other = torch.randn(64, 576, generator=g)
    other[:, 1::9] *= 40.0  # none of the first rows' channels
    before = screen.candidates[1]
    assert torch.equal(screen.argmax(ops, other), reference(ops, other, weight))
    assert screen.candidates[1] - before >= 64


def test_ties_take_the_first_index(ops):
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(500, 64, generator=g)
    hidden = torch.randn(1, 64, generator=g).expand(6, 64).contiguous()
    weight[250] = hidden[0] * 0.5  # the clear winner, then copied: four identical rows, equal logits
    for row in (17, 123, 400):
        weight[row] = weight[250].clone()
    tokens = screened(ops, hidden, weight)[1]
    assert torch.equal(tokens, reference(ops, hidden, weight))
    assert int(tokens[0]) == 17


def test_near_ties_below_the_codes_resolution(ops):
    """Two tokens whose logits differ far below what the codes resolve: both are candidates, the float32 product
    of each decides as the panel GEMM's would."""
    g = torch.Generator().manual_seed(12)
    weight = torch.randn(800, 576, generator=g) * 0.05
    hidden = heavy_rows(32, 576, g)
    weight[301] = weight[300] * (1 + 1e-6)
    weight[300] = weight[300] * 3
    weight[301] = weight[300] * (1 + torch.randn(576, generator=g) * 1e-6)
    assert torch.equal(screened(ops, hidden, weight)[1], reference(ops, hidden, weight))


def test_zero_and_non_finite_rows(ops):
    weight = torch.randn(300, 576, generator=torch.Generator().manual_seed(13))
    zero = torch.zeros(3, 576)
    screen, tokens = screened(ops, zero, weight)
    assert torch.equal(tokens, reference(ops, zero, weight))  # every logit 0: the first index
    bad = torch.randn(2, 576)
    bad[1, 5] = float("nan")
    assert screen.argmax(ops, bad) is None  # the whole product decides for such rows


def test_refuses_what_it_cannot_take(ops):
    assert LmScreen.build(ops, torch.randn(10, 576).to(torch.bfloat16)) is None
    assert LmScreen.build(ops, torch.randn(10, MAX_HIDDEN + 1)) is None  # past what int32 sums hold
    weight = torch.randn(40, 64)
    prepared = ops.lm_screen_prepare(weight)
    outliers = torch.tensor([3, 70])
    with pytest.raises(RuntimeError, match="outside"):
        ops.lm_screen_argmax(torch.randn(2, 64), weight, prepared, outliers, ops.f32_pack_weight(torch.randn(40, 2)))
    with pytest.raises(RuntimeError, match="lm_screen_prepare"):
        ops.lm_screen_argmax(torch.randn(2, 64), weight, ops.lm_screen_prepare(torch.randn(41, 64)),
                             torch.tensor([3]), ops.f32_pack_weight(torch.randn(40, 1)))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 700), k=st.integers(1, 300), scale=st.sampled_from([1.0, 30.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_any_shape(ops, m, n, k, scale, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    hidden = heavy_rows(m, k, g, scale)
    assert torch.equal(screened(ops, hidden, weight)[1], reference(ops, hidden, weight))

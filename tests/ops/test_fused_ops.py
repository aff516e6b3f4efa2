"""The fused C++ helpers (norms, rotary, logits pass) against plain torch on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpage.ops import kernels_error, load_kernels
from tests.helpers.kernels import have_cxx

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


def test_kernels_build_where_a_compiler_exists():
    assert load_kernels() is not None, kernels_error()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_and_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    ops = load_kernels()
    x = torch.randn(7, 576, generator=g).to(dtype)
    res = torch.randn(7, 576, generator=g)
    w = torch.randn(576, generator=g).to(dtype)
    expect_res = res + x.float()
    out = ops.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(res, expect_res)  # the residual stream is updated in place, in float32
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out.float(), rms(expect_res, w, 1e-5), **tol)
    assert out.dtype == dtype
    torch.testing.assert_close(ops.rms_norm(res, w, 1e-5).float(), rms(res, w, 1e-5), **tol)


def test_rotary_matches_rotate_half():
    g = torch.Generator().manual_seed(1)
    ops = load_kernels()
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=g)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)
    ang = torch.randn(5, 32, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()

    def rot(x):
        x1, x2 = x[..., :32], x[..., 32:]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    eq, ek = rot(q.clone()), rot(k.clone())
    ops.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, eq)
    torch.testing.assert_close(k, ek)


@pytest.mark.parametrize("vocab", [1000, 49152, 37])  # lengths with and without a 16-lane tail
def test_logits_postprocess_fp32(vocab):
    g = torch.Generator().manual_seed(vocab)
    ops = load_kernels()
    logits = torch.randn(6, vocab, generator=g) * 4
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins, as torch.argmax
    out, amax, lse = ops.logits_postprocess(logits, torch.zeros(6, 1), torch.zeros(1, 1))
    assert torch.equal(out, logits)
    assert torch.equal(amax, logits.argmax(-1))
    assert int(amax[2]) == 5
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)


def test_logits_postprocess_bf16_recomputes_near_max_entries_exactly():
    g = torch.Generator().manual_seed(3)
    ops = load_kernels()
    vocab, hidden = 4099, 576
    weight = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
    h = torch.randn(8, hidden, generator=g)
    exact = h @ weight.float().T
    raw = (h.bfloat16() @ weight.T).to(torch.bfloat16)
    out, amax, lse = ops.logits_postprocess(raw, h, weight)
    assert torch.equal(amax, exact.argmax(-1))  # bf16 rounding of the matmul output cannot flip the top entry
    for b in range(8):
        top = int(amax[b])
        torch.testing.assert_close(out[b, top], exact[b, top], rtol=1e-5, atol=1e-5)
        assert out[b, top] == out[b].max()
    torch.testing.assert_close(lse, torch.logsumexp(out, -1), rtol=1e-5, atol=1e-5)
    empty, amax_only, no_lse = ops.logits_postprocess(raw, h, weight, False)  # greedy steps: the argmax alone
    assert torch.equal(amax_only, amax) and empty.numel() == 0 and no_lse.numel() == 0
    logits32 = torch.randn(5, 1000, generator=g)
    assert torch.equal(ops.logits_postprocess(logits32, h, weight, False)[1], logits32.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(4)
    ops = load_kernels()
    gu = (torch.randn(9, 2 * 1537, generator=g) * 6).to(dtype)  # odd width: a 16-lane tail
    gu[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # saturated exponentials stay finite
    expect = (F.silu(gu[:, :1537].float()) * gu[:, 1537:].float()).to(dtype)
    out = ops.silu_mul(gu)
    assert out.dtype == dtype and out.shape == (9, 1537)
    assert torch.isfinite(out).all()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    torch.testing.assert_close(out, expect, **tol)

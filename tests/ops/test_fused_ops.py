"""The fused C++ helpers (norms, rotary, logits pass) against plain torch on the same inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvpage.ops import kernels, kernels_error, load_kernels
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


def test_norm_and_rotary_refuse_tables_and_weights_of_the_wrong_size():
    """Each kernel reads its weight or cos/sin table a row's width at a time: a short one is refused by name,
    never read past its end."""
    ops = load_kernels()
    res, x = torch.randn(4, 576), torch.randn(4, 576)
    with pytest.raises(RuntimeError, match="norm weight must be contiguous with 576 elements"):
        ops.rms_norm(res, torch.randn(512), 1e-5)
    with pytest.raises(RuntimeError, match="norm weight must be contiguous with 576 elements"):
        ops.add_rms_norm(x, res, torch.randn(1152)[::2], 1e-5)
    q, k = torch.randn(4, 9, 64), torch.randn(4, 3, 64)
    half = torch.randn(4, 32)  # a half-width table (one angle per pair) where the kernel takes [tokens, D]
    with pytest.raises(RuntimeError, match=r"cos/sin must be \[4, 64\]"):
        ops.rotary_(q, k, half, half)
    with pytest.raises(RuntimeError, match=r"cos/sin must be \[4, 64\]"):
        ops.rotary_(q, k, torch.randn(3, 64), torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="k must have q's tokens"):
        ops.rotary_(q, torch.randn(5, 3, 64), torch.randn(4, 64), torch.randn(4, 64))


@pytest.mark.parametrize("dim", [64, 48, 256])  # 16-lane halves, a masked tail, Gemma 3's head size
def test_rotary_bf16_rows_in_place(dim):
    """bf16 q and k as views into one qkv row (the engine's layout): each element computed in float32 and
    rounded once to bf16 (within one bf16 rounding of torch's float32 formula), nothing else in the row
    touched."""
    g = torch.Generator().manual_seed(dim)
    ops = load_kernels()
    qkv = torch.randn(7, (4 + 2 + 2) * dim, generator=g).bfloat16()
    before = qkv.clone()
    q = qkv[:, : 4 * dim].view(7, 4, dim)
    k = qkv[:, 4 * dim : 6 * dim].view(7, 2, dim)
    ang = torch.randn(7, dim // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()

    def rot(x):
        x = x.float()
        x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    eq, ek = rot(q), rot(k)
    ops.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q.float(), eq, rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(k.float(), ek, rtol=8e-3, atol=1e-2)
    assert torch.equal(qkv[:, 6 * dim :], before[:, 6 * dim :])  # v untouched


@pytest.mark.parametrize("vocab", [1000, 49152, 37])  # lengths with and without a 16-lane tail
def test_logits_postprocess_fp32(vocab):
    g = torch.Generator().manual_seed(vocab)
    ops = load_kernels()
    logits = torch.randn(6, vocab, generator=g) * 4
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins, as torch.argmax
    out, amax, lse = ops.logits_postprocess([logits], torch.zeros(6, 1), torch.zeros(1, 1))
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
    out, amax, lse = ops.logits_postprocess([raw], h, weight)
    assert torch.equal(amax, exact.argmax(-1))  # bf16 rounding of the matmul output cannot flip the top entry
    for b in range(8):
        top = int(amax[b])
        torch.testing.assert_close(out[b, top], exact[b, top], rtol=1e-5, atol=1e-5)
        assert out[b, top] == out[b].max()
    torch.testing.assert_close(lse, torch.logsumexp(out, -1), rtol=1e-5, atol=1e-5)
    empty, amax_only, no_lse = ops.logits_postprocess([raw], h, weight, False)  # greedy steps: the argmax alone
    assert torch.equal(amax_only, amax) and empty.numel() == 0 and no_lse.numel() == 0
    # exact ties: a copy of row 0's top entry at index 0 and at the end; both paths pick the first index
    tied = weight.clone()
    top0 = int(amax[0])
    tied[0] = tied[-1] = weight[top0]
    raw_tied = (h.bfloat16() @ tied.T).to(torch.bfloat16)
    full = ops.logits_postprocess([raw_tied], h, tied)[1]
    only = ops.logits_postprocess([raw_tied], h, tied, False)[1]
    assert int(full[0]) == int(only[0]) == 0
    assert torch.equal(full, only)
    # the logits as uneven column parts (the lm head's vocabulary slices), into a buffer kept across steps
    cuts = [0, 1000, 1016, 4000, vocab]
    parts = [raw[:, a:b].contiguous() for a, b in itertools.pairwise(cuts)]
    buf = torch.full((9 * vocab + 5,), float("nan"))
    p_out, p_amax, p_lse = ops.logits_postprocess(parts, h, weight, True, buf)
    assert p_out.data_ptr() == buf.data_ptr() and p_out.shape == (8, vocab)
    assert torch.equal(p_out, out) and torch.equal(p_amax, amax) and torch.equal(p_lse, lse)
    assert torch.equal(ops.logits_postprocess(parts, h, weight, False)[1], amax)
    f32_parts = [p.float() for p in parts]
    assert torch.equal(ops.logits_postprocess(f32_parts, h, weight, False)[1], raw.float().argmax(-1))
    with pytest.raises(RuntimeError, match="at least rows x vocab"):
        ops.logits_postprocess(parts, h, weight, True, torch.empty(8 * vocab - 1))
    logits32 = torch.randn(5, 1000, generator=g)
    assert torch.equal(ops.logits_postprocess([logits32], h, weight, False)[1], logits32.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("op", "act"), [("silu_mul", F.silu), ("gelu_mul", lambda x: F.gelu(x, approximate="tanh"))])
def test_gated_activations_match_torch(dtype, op, act):
    g = torch.Generator().manual_seed(4)
    ops = load_kernels()
    gu = (torch.randn(9, 2 * 1537, generator=g) * 6).to(dtype)  # odd width: a 16-lane tail
    gu[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # saturated exponentials stay finite
    expect = (act(gu[:, :1537].float()) * gu[:, 1537:].float()).to(dtype)
    out = getattr(ops, op)(gu)
    assert out.dtype == dtype and out.shape == (9, 1537)
    assert torch.isfinite(out).all()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    torch.testing.assert_close(out, expect, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_norm_add_norm_is_the_two_norms_in_sequence(dtype, out_dtype):
    """Gemma's sandwich norms in one kernel: the same bits as rms_norm, add_rms_norm and the cast in turn."""
    ops = kernels()
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(37, 640, generator=g) * 4).to(dtype)
    residual = torch.randn(37, 640, generator=g) * 10
    before = residual.clone()
    w1, w2 = torch.rand(640, generator=g) + 0.5, torch.rand(640, generator=g) + 0.5
    expect_res = residual.clone()
    expect = ops.add_rms_norm(ops.rms_norm(x.float(), w1, 1e-6), expect_res, w2, 1e-6).to(out_dtype)
    out = ops.norm_add_norm(x, residual, w1, w2, 1e-6, out_dtype)
    assert out.dtype == out_dtype and torch.equal(out, expect) and torch.equal(residual, expect_res)
    torch.testing.assert_close(residual, before + F.rms_norm(x.float(), (640,), eps=1e-6) * w1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), (F.rms_norm(residual, (640,), eps=1e-6) * w2).to(out_dtype).float(),
                               rtol=1e-2 if out_dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_is_norm_cast_and_rotary_in_sequence(dtype):
    """Gemma's QK-norm and RoPE in one kernel: the same bits as rms_norm per head, the cast and rotary_."""
    ops = kernels()
    g = torch.Generator().manual_seed(7)
    t, hq, hk, d = 13, 4, 1, 256
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g) * 3).to(dtype)
    qw, kw = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    pos = torch.arange(100, 100 + t, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(0, d, 2) / d))[None]
    emb = torch.cat([pos, pos], -1)
    cos, sin = emb.cos(), emb.sin()
    q_end, k_end = hq * d, (hq + hk) * d
    eq = ops.rms_norm(qkv[:, :q_end].float().contiguous().view(t * hq, d), qw, 1e-6).to(dtype).view(t, hq, d)
    ek = ops.rms_norm(qkv[:, q_end:k_end].float().contiguous().view(t * hk, d), kw, 1e-6).to(dtype).view(t, hk, d)
    ops.rotary_(eq, ek, cos, sin)
    q, k = ops.qk_norm_rope(qkv, qw, kw, 1e-6, cos, sin, hq, hk)
    assert q.shape == (t, hq, d) and k.shape == (t, hk, d) and q.dtype == k.dtype == dtype
    assert torch.equal(q, eq) and torch.equal(k, ek)
    from kvpage.model.rope import apply_rope
    ref_q = apply_rope(F.rms_norm(qkv[:, :q_end].float().view(t, hq, d), (d,), eps=1e-6) * qw, cos, sin)
    torch.testing.assert_close(q.float(), ref_q, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-2)


def test_packed_linear_split_rows_gives_the_same_logits():
    """An lm head whose oneDNN product runs by vocabulary slices: the same outputs, and the same logits pass."""
    from kvpage.envs import KernelConfig
    from kvpage.model.fast_path import packed_logits
    from kvpage.model.layers.linear import PackedLinear, packing_available
    from kvpage.model.logits import LogitsBuffer
    from kvpage.ops import kernels

    if not packing_available():
        pytest.skip("no bf16 oneDNN packing on this CPU")
    ops = kernels(KernelConfig(amx_linear=False, quant_max_tokens=0))
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(1000, 64, generator=g) * 0.1).bfloat16()
    whole, split = PackedLinear(w, None, ops=ops), PackedLinear(w, None, ops=ops, split_rows=384)
    assert whole.packed is not None and split.packed is None and len(split.packed_parts) == 3
    h = torch.randn(37, 64, generator=g)
    parts = list(split.forward_parts(h.bfloat16()))
    assert [(s, p.shape[1]) for s, p in parts] == [(0, 384), (384, 384), (768, 232)]
    assert torch.equal(torch.cat([p for _, p in parts], 1), whole(h.bfloat16()))
    assert torch.equal(split(h.bfloat16()), whole(h.bfloat16()))
    buffer = LogitsBuffer()
    for argmax_only in (False, True):
        a = packed_logits(ops, whole, w, h, argmax_only)
        for buf in (None, buffer):
            b = packed_logits(ops, split, w, h, argmax_only, buf)
            assert torch.equal(a.argmax, b.argmax)
            if not argmax_only:
                assert torch.equal(a.logits, b.logits) and torch.equal(a.lse, b.lse)
        assert torch.equal(a.argmax, (h @ w.float().T).argmax(-1))
    # past row_major_max_bytes of head output the split head keeps one slice alive at a time (logits_scan per
    # slice, then logits_finish): the same bits as the whole head's pass, which goes row by row
    a, b = packed_logits(ops, whole, w, h, False), packed_logits(ops, split, w, h, False, row_major_max_bytes=0)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.argmax, b.argmax) and torch.equal(a.lse, b.lse)
    kept = packed_logits(ops, split, w, h, False, buffer).logits
    assert kept.data_ptr() == packed_logits(ops, split, w, h[:5], False, buffer).logits.data_ptr()  # reused
    assert packed_logits(ops, split, w, h[:0], False).logits.shape == (0, 1000)


def test_amx_lm_head_by_slices_gives_the_same_logits():
    """The AMX tile GEMM's head by vocabulary slices (views of its packed operand): the same bits as whole."""
    from kvpage.envs import KernelConfig
    from kvpage.model.fast_path import packed_logits
    from kvpage.model.layers.linear import PackedLinear
    from kvpage.ops import kernels

    ops = kernels(KernelConfig(quant_max_tokens=0))
    if not ops.amx_linear_ok:
        pytest.skip("no AMX tile GEMM on this CPU/OS")
    g = torch.Generator().manual_seed(12)
    w = (torch.randn(992, 64, generator=g) * 0.1).bfloat16()
    whole, split = PackedLinear(w, None, ops=ops), PackedLinear(w, None, ops=ops, split_rows=384)
    assert whole.amx_split is None and split.amx_split == 384
    h = torch.randn(37, 64, generator=g)
    parts = list(split.forward_parts(h.bfloat16()))
    assert [(s, p.shape[1]) for s, p in parts] == [(0, 384), (384, 384), (768, 224)]
    assert torch.equal(torch.cat([p for _, p in parts], 1), whole(h.bfloat16()))
    assert torch.equal(split(h.bfloat16()), whole(h.bfloat16()))
    for argmax_only in (False, True):
        a, b = packed_logits(ops, whole, w, h, argmax_only), packed_logits(ops, split, w, h, argmax_only)
        assert torch.equal(a.argmax, b.argmax)
        if not argmax_only:
            assert torch.equal(a.logits, b.logits) and torch.equal(a.lse, b.lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_draw_is_the_logits_pass_then_sample_rows(dtype):
    """Drawing each row inside the logits pass reads the same finished float32 row as logits_postprocess
    followed by sample_rows, so it gives the same tokens (temperature 0: the argmax), from the head's parts."""
    g = torch.Generator().manual_seed(11)
    ops = load_kernels()
    vocab, hidden, rows = 3001, 64, 12
    weight = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    h = torch.randn(rows, hidden, generator=g)
    raw = (h.to(dtype) @ weight.T).to(dtype)
    parts = [raw[:, a:b].contiguous() for a, b in itertools.pairwise([0, 1000, 1016, vocab])]
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.0, 2.0, 0.5, 1.0, 1.0, 0.9, 1.1])
    top_k = torch.tensor([0, 0, 50, 0, 5, 0, 1, 0, vocab, 20, 0, 3000])
    top_p = torch.tensor([1.0, 1.0, 0.95, 0.9, 1.0, 1.0, 1.0, 0.5, 0.8, 0.99, 1.0, 0.7])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.05, 0.2, 0.0])
    u = torch.rand(rows, 2, generator=g, dtype=torch.float64)
    tokens, amax = ops.logits_draw(parts, h, weight, temps, top_k, top_p, min_p, u)
    logits, ref_amax, _ = ops.logits_postprocess(parts, h, weight)
    assert torch.equal(amax, ref_amax)
    drawn = temps > 0
    idx = drawn.nonzero().flatten()
    ref = ops.sample_rows(logits, idx, temps[idx], top_k[idx], top_p[idx], min_p[idx], u[idx].contiguous())
    assert torch.equal(tokens[idx], ref)
    assert torch.equal(tokens[~drawn], ref_amax[~drawn, None].expand(-1, 2))
    with pytest.raises(RuntimeError, match="one temperature"):
        ops.logits_draw(parts, h, weight, temps[:-1], top_k, top_p, min_p, u)
    with pytest.raises(RuntimeError, match="temperature must be >= 0"):
        ops.logits_draw(parts, h, weight, -temps, top_k, top_p, min_p, u)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_draw_with_masks_is_the_masked_logits_then_sample_rows(dtype):
    """A row with an allowed-token mask draws as the sampler does from its logits with every other entry at
    -inf (a greedy row: the first allowed maximum; no token allowed: the model's argmax); rows without one
    draw as before; a mask shorter than the vocabulary allows nothing past its words."""
    g = torch.Generator().manual_seed(13)
    ops = load_kernels()
    vocab, hidden, rows = 3001, 64, 8
    weight = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    h = torch.randn(rows, hidden, generator=g)
    parts = [(h.to(dtype) @ weight.T).to(dtype).contiguous()]
    temps = torch.tensor([1.0, 0.0, 0.8, 1.0, 0.0, 1.2, 1.0, 0.0])
    top_k = torch.tensor([0, 0, 40, 0, 0, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.95, 1.0, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    u = torch.rand(rows, 1, generator=g, dtype=torch.float64)
    words = (vocab + 31) // 32
    keep = torch.rand(4, words * 32, generator=g) < torch.tensor([0.5, 0.02, 0.9, 0.0])[:, None]
    keep[1, 3] = True  # a sparse mask with at least one token
    masks = torch.from_numpy(np.packbits(keep.numpy(), axis=1, bitorder="little").view(np.int32).copy())
    short = masks[:, : words - 20].contiguous()  # tokens past 32 * (words - 20) never allowed
    mask_of = torch.tensor([0, 0, 2, -1, 1, 1, 3, 3])
    logits, ref_amax, _ = ops.logits_postprocess(parts, h, weight)
    for m, width in ((masks, words * 32), (short, (words - 20) * 32)):
        tokens, amax = ops.logits_draw(parts, h, weight, temps, top_k, top_p, min_p, u, mask_of, m)
        assert torch.equal(amax, ref_amax)
        for b in range(rows):
            x = logits[b].clone()
            if mask_of[b] >= 0:
                allowed = keep[mask_of[b], :vocab].clone()
                allowed[width:] = False
                x[~allowed] = float("-inf")
            if x.max() == float("-inf"):
                want = int(ref_amax[b])  # nothing allowed: the model's argmax
            elif temps[b] == 0:
                want = int(x.argmax())
            else:
                want = int(ops.sample_rows(x[None].contiguous(), torch.tensor([0]), temps[b : b + 1], top_k[b : b + 1],
                                           top_p[b : b + 1], min_p[b : b + 1], u[b : b + 1])[0, 0])
            assert int(tokens[b, 0]) == want, b
            if mask_of[b] >= 0 and x.max() > float("-inf"):
                assert bool(keep[mask_of[b], want])
    plain, _ = ops.logits_draw(parts, h, weight, temps, top_k, top_p, min_p, u)
    unmasked = mask_of < 0
    assert torch.equal(plain[unmasked], ops.logits_draw(parts, h, weight, temps, top_k, top_p, min_p, u,
                                                        mask_of, masks)[0][unmasked])
    with pytest.raises(RuntimeError, match="come together"):
        ops.logits_draw(parts, h, weight, temps, top_k, top_p, min_p, u, mask_of, None)
    with pytest.raises(RuntimeError, match="not there"):
        ops.logits_draw(parts, h, weight, temps, top_k, top_p, min_p, u, torch.full((rows,), 4), masks)

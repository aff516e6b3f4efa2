"""The AMX tile GEMM for bf16 projections (ops/csrc/linear/linear_amx.cpp): matches a float32 product on ragged row
counts (partial row tiles, odd numbers of row tiles, more rows than one activation chunk), adds the bias, gives
every row the same bits whatever batch it is in, refuses shapes it cannot take, and PackedLinear routes to it
only in its row range."""

from __future__ import annotations

import pytest
import torch

from kvpage.envs import KernelConfig
from kvpage.model.layers.linear import PackedLinear
from kvpage.ops import ACT_GELU_TANH, ACT_SILU, kernels
from tests.helpers.kernels import amx_ops


def _ops():
    return amx_ops("amx_linear_available")


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 48, 100, 257, 300, 1000])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 64), (960, 576), (64, 1536)])
def test_matches_float32_product(rows, n, k):
    ops = _ops()
    x, w, b = _rand(rows, k, seed=rows), _rand(n, k, seed=n + k), _rand(n, seed=7)
    wp = ops.amx_pack_weight(w)
    ref = x.float() @ w.float().T
    # float32 sums, one rounding to bf16 (relative 2^-8) plus summation-order differences
    tol = 2 ** -8 * ref.abs() + 1e-3 * k**0.5
    y = ops.amx_linear(x, wp)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert ((y.float() - ref).abs() <= tol).all()
    yb = ops.amx_linear(x, wp, b)
    assert ((yb.float() - (ref + b.float())).abs() <= tol + 2 ** -8 * b.float().abs()).all()


@pytest.mark.parametrize("rows", [1, 16, 19, 45, 300])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_epilogue_matches_projection_then_act_mul(rows, act):
    ops = _ops()
    x, w = _rand(rows, 576, seed=rows), _rand(2 * 48, 576, seed=9) * 3  # large values: both tails
    code, separate = (ACT_SILU, ops.silu_mul) if act == "silu" else (ACT_GELU_TANH, ops.gelu_mul)
    fused = ops.amx_linear(x, ops.amx_pack_gate_up(w), None, code)
    assert fused.shape == (rows, 48)
    assert torch.equal(fused, separate(ops.amx_linear(x, ops.amx_pack_weight(w))))
    with pytest.raises(RuntimeError, match="no bias"):
        ops.amx_linear(x, ops.amx_pack_gate_up(w), torch.zeros(96), code)
    with pytest.raises(RuntimeError, match="act must be"):
        ops.amx_linear(x, ops.amx_pack_gate_up(w), None, 3)


def test_rows_do_not_depend_on_the_batch():
    ops = _ops()
    x, w = _rand(75, 576, seed=1), _rand(960, 576, seed=2)
    wp = ops.amx_pack_weight(w)
    full = ops.amx_linear(x, wp)
    for i in (0, 15, 16, 63, 64, 74):  # in full tiles, in the partial last tile, alone (staged)
        assert torch.equal(ops.amx_linear(x[i : i + 1], wp)[0], full[i])
    assert torch.equal(ops.amx_linear(x[10:50], wp), full[10:50])


def test_rows_across_activation_chunks():
    """Long inputs are taken ~1 MiB of activations at a time (320 rows at K = 1536, 896 at K = 576): rows on
    either side of a chunk's edge, and a chunk cut short at the end, give the bits they give alone."""
    ops = _ops()
    for k, edges in ((1536, (319, 320, 639, 640)), (576, (895, 896))):
        x, w = _rand(1000, k, seed=k), _rand(96, k, seed=k + 1)
        wp = ops.amx_pack_weight(w)
        full = ops.amx_linear(x, wp)
        for i in (0, *edges, 999):
            assert torch.equal(ops.amx_linear(x[i : i + 1], wp)[0], full[i])
        assert torch.equal(ops.amx_linear(x[300:700], wp), full[300:700])


@pytest.mark.parametrize("gated", [False, True])
def test_column_block_groups_give_the_bits_of_single_rows(gated):
    """From 256 rows the kernel runs four column blocks per pair of row tiles (a last group of two here: 30 or
    15 blocks): every row, bias and gated epilogue included, has the bits it has alone (one block at a time)."""
    ops = _ops()
    x, w, b = _rand(300, 576, seed=3), _rand(960, 576, seed=4), _rand(960, seed=5)
    wp = ops.amx_pack_gate_up(w) if gated else ops.amx_pack_weight(w)
    full = ops.amx_linear(x, wp, None, ACT_SILU) if gated else ops.amx_linear(x, wp, b)
    for i in (0, 31, 32, 255, 256, 299):
        one = ops.amx_linear(x[i : i + 1], wp, None, ACT_SILU) if gated else ops.amx_linear(x[i : i + 1], wp, b)
        assert torch.equal(one[0], full[i])
    part = ops.amx_linear(x[:100], wp, None, ACT_SILU) if gated else ops.amx_linear(x[:100], wp, b)
    assert torch.equal(part, full[:100])


def test_non_contiguous_input_and_empty_batch():
    ops = _ops()
    w = _rand(64, 64, seed=3)
    wp = ops.amx_pack_weight(w)
    wide = _rand(20, 128, seed=4)
    assert torch.equal(ops.amx_linear(wide[:, :64], wp), ops.amx_linear(wide[:, :64].contiguous(), wp))
    assert ops.amx_linear(wide[:0, :64], wp).shape == (0, 64)


def test_bad_shapes_are_refused():
    ops = _ops()
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.amx_pack_weight(_rand(48, 40, seed=1))
    wp = ops.amx_pack_weight(_rand(64, 64, seed=1))
    with pytest.raises(RuntimeError, match="columns"):
        ops.amx_linear(_rand(4, 96, seed=2), wp)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(torch.randn(4, 64), wp)
    with pytest.raises(RuntimeError, match="bias"):
        ops.amx_linear(_rand(4, 64, seed=2), wp, torch.zeros(3))


def test_packed_linear_routes_by_rows():
    _ops()
    ops = kernels(KernelConfig())
    w = _rand(96, 64, seed=5)
    lin = PackedLinear(w, None, ops=ops, amx_max_rows=40)
    assert lin.amx is not None
    calls = []
    real = ops.amx_linear

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def amx_linear(self, *a):
            calls.append(a[0].shape[0])
            return real(*a)

    lin.ops = Spy()
    x = _rand(64, 64, seed=6)
    ref = x.float() @ w.float().T
    for rows in (40, 41):
        y = lin(x[:rows])
        assert ((y.float() - ref[:rows]).abs() <= 2 ** -8 * ref[:rows].abs() + 0.01).all()
    assert calls == [40]  # 41 rows went to oneDNN
    everywhere = PackedLinear(w, None, ops=kernels(KernelConfig(amx_linear_max_rows=0)))  # no oneDNN copy
    assert everywhere.packed is None and everywhere.amx_max_rows >= 1 << 40 and everywhere.amx_plain_rows >= 1 << 40
    layer = PackedLinear(w, None, ops=ops)  # the default: prompt steps past 1,536 rows on oneDNN's packing
    assert layer.packed is not None and layer.amx_max_rows == layer.amx_plain_rows == 1536
    assert PackedLinear(_rand(80, 64, seed=1), None, ops=ops).amx is None  # 80 % 32 != 0: oneDNN only
    gated = PackedLinear(w, None, ops=ops, amx_max_rows=40, gated=True)  # [gate; up], 48 each
    assert gated.out_features == 48
    for rows in (3, 40, 41):  # quantized path absent: AMX up to 40 rows, oneDNN + silu_mul above
        y = gated(x[:rows])
        g, u = ref[:rows, :48].bfloat16().float(), ref[:rows, 48:].bfloat16().float()
        assert torch.allclose(y.float(), (g * torch.sigmoid(g) * u), rtol=0.02, atol=0.02)
    gelu = PackedLinear(w, None, ops=ops, amx_max_rows=40, gated=True, activation="gelu_tanh")
    for rows in (3, 40, 41):  # AMX's epilogue up to 40 rows, oneDNN + gelu_mul above
        y = gelu(x[:rows])
        g, u = ref[:rows, :48].bfloat16().float(), ref[:rows, 48:].bfloat16().float()
        assert torch.allclose(y.float(), torch.nn.functional.gelu(g, approximate="tanh") * u, rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="activation"):
        PackedLinear(w, None, ops=ops, gated=True, activation="relu")
    assert PackedLinear(w, None, ops=kernels(KernelConfig(amx_linear=False))).amx is None


@pytest.mark.parametrize("rows", [1, 17, 100, 257])
@pytest.mark.parametrize("n", [32, 960, 4096])
def test_streamed_output_is_the_same_bits(rows, n):
    """stream=True (the lm head's logits, written with non-temporal stores) changes where the lines go, not
    what they hold: bit-equal to the plain stores, with a bias too; a gated product ignores it."""
    ops = _ops()
    x, w, b = _rand(rows, 576, seed=rows), _rand(n, 576, seed=n), _rand(n, seed=3)
    wp = ops.amx_pack_weight(w)
    assert torch.equal(ops.amx_linear(x, wp, stream=True), ops.amx_linear(x, wp))
    assert torch.equal(ops.amx_linear(x, wp, b, stream=True), ops.amx_linear(x, wp, b))
    gp = ops.amx_pack_gate_up(w)
    assert torch.equal(ops.amx_linear(x, gp, None, ACT_SILU, True), ops.amx_linear(x, gp, None, ACT_SILU))


def test_packed_linear_streams_only_where_asked():
    """An lm head (stream_out) asks the tile GEMM for streamed output, whole or by vocabulary slices; other
    projections do not; both give the plain product's bits."""
    _ops()
    ops = kernels(KernelConfig())
    w, x = _rand(256, 64, seed=8), _rand(24, 64, seed=9)
    seen = []
    real = ops.amx_linear

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def amx_linear(self, *a, **kw):
            seen.append(a[4] if len(a) > 4 else kw.get("stream", False))
            return real(*a, **kw)

    plain = PackedLinear(w, None, ops=ops)
    head = PackedLinear(w, None, ops=ops, stream_out=True)
    sliced = PackedLinear(w, None, ops=ops, split_rows=96, stream_out=True)
    for lin in (plain, head, sliced):
        lin.ops = Spy()
    want = plain(x)
    assert torch.equal(head(x), want)
    assert torch.equal(torch.cat([part for _, part in sliced.forward_parts(x)], dim=1), want)
    assert seen == [False, True, True, True, True]  # plain, head, then the slices of 96, 96, 64 columns


def test_row_limit_from_the_kernel_configuration():
    """KVPAGE_AMX_LINEAR_MAX_ROWS (KernelConfig.amx_linear_max_rows) sets the row limit of every projection that
    does not give its own: calls of more rows take oneDNN's packing, close to the tile GEMM's product; an lm head
    (streamed output, its own limit) is not affected."""
    _ops()
    ops = kernels(KernelConfig(amx_linear_max_rows=40))
    w, x = _rand(96, 64, seed=11), _rand(64, 64, seed=12)
    lin = PackedLinear(w, None, ops=ops)
    assert lin.amx_max_rows == lin.amx_plain_rows == 40 and lin.packed is not None
    tile = ops.amx_linear(x, lin.amx)
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def amx_linear(self, *a):
            calls.append(a[0].shape[0])
            return ops.amx_linear(*a)

    lin.ops = Spy()
    assert torch.equal(lin(x[:40]), tile[:40])  # the tile GEMM up to the limit
    above = lin(x[:41])  # oneDNN: the same product up to the order of its sums
    assert calls == [40]
    assert torch.allclose(above.float(), tile[:41].float(), rtol=2 ** -7, atol=2 ** -7)
    head = PackedLinear(w, None, ops=ops, stream_out=True)
    assert head.amx_max_rows >= 1 << 40 and head.packed is None and head.amx_plain_rows == 0
    long_k = PackedLinear(_rand(32, 2048, seed=13), None, ops=ops)  # K past ONEDNN_PROMPT_MAX_K: tile GEMM only
    assert long_k.amx_max_rows >= 1 << 40 and long_k.packed is None

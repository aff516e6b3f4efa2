"""The key/value transform's rows (attention/kv_affine.cpp): the compiled pass gives the bits of its torch oracle
(kv_transform.affine_rows) for float32 and bfloat16 rows, head sizes the vector lanes take (powers of two up to
256) and ones they leave to the scalar loop, every combination of parts, and rows read through strided views of a
fused q|k|v projection; the rotation is its own inverse; bad arguments are refused by name."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from kvpage.attention.kv_quant import hadamard
from kvpage.attention.kv_transform import affine_rows
from kvpage.ops import load_kernels
from tests.helpers.kernels import have_cxx

needs_cxx = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


def check_affine_rows(fn: Callable[..., torch.Tensor]) -> None:
    """``fn`` (a build's kv_affine_rows) against the oracle, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    for dim, heads, dtype in itertools.product((8, 16, 64, 96, 256), (1, 3), (torch.float32, torch.bfloat16)):
        tokens = 37
        # a fused projection's output: q|k|v side by side, so a head's rows are a strided view
        fused = torch.randn(tokens, (heads + 2) * dim, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen))
        x = fused.to(dtype)[:, dim : dim * (heads + 1)].view(tokens, heads, dim)
        assert not x.is_contiguous()
        sub = torch.randn(heads, dim, generator=gen)
        mul = torch.exp2(torch.randint(-3, 4, (heads, dim), generator=gen).float())
        add = torch.randn(heads, dim, generator=gen)
        for use_sub, use_mul, rotate, use_add in itertools.product((False, True), repeat=4):
            args = (sub if use_sub else None, mul if use_mul else None, rotate, add if use_add else None)
            ours, ref = fn(x, *args), affine_rows(x, *args)
            assert ours.dtype == dtype and ours.shape == x.shape
            assert torch.equal(ours, ref), (dim, heads, dtype, use_sub, use_mul, rotate, use_add)


@needs_cxx
def test_compiled_rows_give_the_oracles_bits():
    check_affine_rows(load_kernels().kv_affine_rows)


@needs_cxx
def test_many_rows_split_over_threads_give_the_same_bits():
    ops = load_kernels()
    x = torch.randn(2048, 4, 256).bfloat16()  # a prompt step of Gemma 3's queries: several tasks
    center = torch.randn(4, 256)
    assert torch.equal(ops.kv_affine_rows(x, center, None, True, None), affine_rows(x, center, None, True, None))
    assert ops.kv_affine_rows(x[:0], None, None, True, None).shape == (0, 4, 256)


def test_the_rotation_is_its_own_inverse():
    x = torch.randn(5, 2, 64)
    there = affine_rows(x, None, None, True, None)
    torch.testing.assert_close(there, hadamard(x))
    torch.testing.assert_close(affine_rows(there, None, None, True, None), x, rtol=1e-5, atol=1e-5)


@needs_cxx
def test_bad_arguments_are_refused_by_name():
    ops = load_kernels()
    x = torch.randn(4, 2, 64)
    with pytest.raises(RuntimeError, match="sub must be a contiguous float32"):
        ops.kv_affine_rows(x, torch.randn(3, 64), None, False, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.kv_affine_rows(x.half(), None, None, True, None)
    with pytest.raises(RuntimeError, match="tokens, heads, head_dim"):
        ops.kv_affine_rows(x.view(4, 128), None, None, True, None)

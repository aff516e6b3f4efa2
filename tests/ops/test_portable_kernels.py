"""The kernels' portable path: the same sources built for a CPU without AVX-512 (x86-64-v2), checked against
the native build and torch on the same inputs. This is what a machine without AVX-512 runs."""

from __future__ import annotations

import platform

import pytest
import torch

from kvpage.model.quant import QuantWeight
from kvpage.ops import PARTITION_SIZE, load_kernels
from kvpage.ops.build import _CSRC, _SOURCES
from tests.helpers.kernels import have_cxx

pytestmark = [
    pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the portable target named here is x86-64-v2"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    from torch.utils.cpp_extension import load

    build = tmp_path_factory.mktemp("portable_build")
    mod = load(name="kvpage_portable_kernels", sources=[str(p) for p in _SOURCES], extra_include_paths=[str(_CSRC)],
               extra_cflags=["-O2", "-march=x86-64-v2", "-fopenmp"], extra_ldflags=["-fopenmp"],
               build_directory=str(build), verbose=False)
    return mod


def random_q4(n: int, k: int, g: torch.Generator) -> QuantWeight:
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half()
    m = (torch.randn(n, k // 32, generator=g) * 0.01).half()
    return QuantWeight(qs, d, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_quant_linear(portable, dtype):
    g = torch.Generator().manual_seed(0)
    q4 = random_q4(40, 96, g)
    q8 = QuantWeight(torch.randint(-128, 128, (24, 96), dtype=torch.int8, generator=g),
                     (torch.rand(24, 3, generator=g) * 0.02).half(), None)
    for qw in (q4, q8):
        x = torch.randn(5, 96, generator=g).to(dtype)
        ref = x.double() @ qw.dequantize().double().T
        out = portable.quant_linear(x, qw.qs, qw.d, qw.m, True)
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_paged_attention_and_fused_ops(portable, dtype):
    native = load_kernels()
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs = 6, 2, 64, 8
    lens = [5, 23, 40]
    blocks = sum(-(-n // bs) for n in lens) + 2
    cache = torch.randn(2, blocks, bs, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables, used = torch.zeros(len(lens), width, dtype=torch.long), 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = torch.tensor(perm[used : used + nb])
        used += nb
    q_lens = [1, 3, 1]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    args = (q, cache, tables, qsl, torch.tensor(lens), dim**-0.5, PARTITION_SIZE)
    assert torch.allclose(portable.paged_attention(*args).float(), native.paged_attention(*args).float(),
                          atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    x = torch.randn(4, 96, generator=g).to(dtype)
    res = torch.randn(4, 96, generator=g)
    w = torch.randn(96, generator=g).to(dtype)
    r1, r2 = res.clone(), res.clone()
    a = portable.add_rms_norm(x, r1, w, 1e-5)
    b = native.add_rms_norm(x, r2, w, 1e-5)
    assert torch.allclose(r1, r2, atol=1e-6) and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=1e-2)
    gu = torch.randn(3, 64, generator=g).to(dtype)
    assert torch.allclose(portable.silu_mul(gu).float(), native.silu_mul(gu).float(), atol=2e-2, rtol=1e-2)

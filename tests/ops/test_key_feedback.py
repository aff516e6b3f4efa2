"""Key rows rounded with feedback (attention/kv_quant.py quantize_rows with ``feedback``, keys_feedback; the
compiled write in ops/csrc/attention/key_feedback.h): the compiled bytes equal the torch oracle's in every code
type, head size and layout, and the rounding does what it is for: a smaller score error for queries like the
ones the matrices came from than rounding each channel alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpage.attention.backends.cpu import CpuPagedAttention
from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.attention.kv_quant import hadamard, keys_feedback, quantize_rows, read_keys, write_rows
from kvpage.envs import KernelConfig
from kvpage.ops import kernels, load_kernels, pack_kv_rows, unpack_kv_rows
from kvpage.worker.kv_cache import as_block_major
from tests.helpers.kernels import have_cxx, step_metadata

CODES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
needs_cxx = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler")


def queries(n: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Queries with a few strong, correlated directions, as a layer's are (a second moment far from isotropic):
    one distribution per head size, ``seed`` draws its samples."""
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(dim)))[0]
    spread = torch.exp(torch.linspace(1.0, -1.0, dim))
    return (torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(seed)) * spread) @ basis.T


def test_the_matrices_are_strictly_upper_and_vanish_for_isotropic_queries():
    fb = keys_feedback(queries(400, 6, 64), kv_heads=2)
    assert fb.shape == (2, 64, 64) and fb.dtype == torch.float32 and fb.is_contiguous()
    assert torch.equal(fb, torch.triu(fb, diagonal=1))
    assert fb.abs().max() > 0.05
    # queries whose second moment is the identity: nothing to gain, nothing passed on
    q = torch.linalg.qr(torch.randn(64, 64))[0][None].expand(3, 64, 64).transpose(0, 1) * 8**0.5
    assert keys_feedback(q.contiguous(), kv_heads=1).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", CODES)
def test_feedback_lowers_the_score_error_of_held_out_queries(dtype):
    """The mean square of q . (stored key - key) over queries the matrices never saw, from the same
    distribution: lower than plain rounding's (GPTQ's argument, the queries' second moment as the Hessian)."""
    dim, kv_heads = 64, 2
    fb = keys_feedback(queries(2000, 6, dim, seed=1), kv_heads)
    test_q = queries(2000, 6, dim, seed=2).view(2000, kv_heads, 3, dim)
    keys = torch.randn(500, kv_heads, dim) * torch.linspace(3, 0.2, dim)
    errors = []
    for f in (None, fb):
        back = read_keys(quantize_rows(hadamard(keys), dtype, f))
        e = back - keys  # [500, kv_heads, D]
        errors.append(float(torch.einsum("qhgd,khd->qkhg", test_q, e).pow(2).mean()))
    assert errors[1] < 0.75 * errors[0], errors
    # and the codes stay codes of the same row scale: no element past the format's range
    rows = quantize_rows(hadamard(keys), dtype, fb)
    assert torch.isfinite(read_keys(rows)).all()


@needs_cxx
@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_compiled_feedback_write_equals_the_oracle_byte_for_byte(dtype, src):
    """Head sizes the lanes take (8-256, powers of two) and the scalar rows (96); token counts that leave idle
    lanes; one token (its own path); zero rows; a strided key view (a qkv slice)."""
    ops = load_kernels()
    torch.manual_seed(1)
    for dim, n in itertools.product((8, 16, 64, 96, 128, 256), (37, 1)):  # 1: a decode step's one row
        kv_heads, bs = 3, 16
        fb = keys_feedback(queries(300, 2 * kv_heads, dim), kv_heads)
        qkv = (torch.randn(n, 2 * kv_heads, dim) * torch.exp(torch.randn(dim))).to(src)
        key = qkv[:, :kv_heads]  # a view: rows kv_heads * dim apart
        value = (torch.randn(n, kv_heads, dim) * 0.1).to(src)
        if n > 4:
            qkv[4, :kv_heads] = 0.0
        cache = torch.zeros(2, 4, bs, kv_heads, dim + 2, dtype=torch.uint8).view(dtype)
        slots = torch.randperm(4 * bs)[:n]
        oracle = cache.clone()
        write_rows(key, value, oracle, slots, fb)
        ours = as_block_major(cache.clone())
        ops.reshape_and_cache(key, value, ours, slots, False, fb)
        assert torch.equal(ours.view(torch.uint8), oracle.view(torch.uint8)), (dim, n)
        plain = cache.clone()
        write_rows(key, value, plain, slots)
        assert not torch.equal(plain.view(torch.uint8), oracle.view(torch.uint8))  # the feedback moved codes


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_packed_pages_take_the_same_feedback_codes(dim, dtype):
    ops = load_kernels()
    if not ops.has_packed_int8_layout():
        pytest.skip("this build has no packed int8 and fp8 layouts (AVX512-VNNI)")
    torch.manual_seed(dim)
    kv_heads, n, bs = 2, 50, 32
    fb = keys_feedback(queries(300, 4 * kv_heads, dim), kv_heads)
    key, value = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    rows = torch.zeros(2, 3, bs, kv_heads, dim + 2, dtype=torch.int8).view(dtype)
    slots = torch.randperm(3 * bs)[:n]
    write_rows(key, value, rows, slots, fb)
    packed = pack_kv_rows(torch.zeros_like(rows))
    ops.reshape_and_cache(key, value, packed, slots, True, fb)
    assert torch.equal(unpack_kv_rows(packed).view(torch.uint8), rows.view(torch.uint8))


@needs_cxx
def test_backends_pass_the_feedback_to_their_writes_and_refuse_it_on_float_caches():
    ops = load_kernels()
    torch.manual_seed(2)
    kv_heads, dim, bs = 2, 64, 16
    fb = keys_feedback(queries(300, 4, dim), kv_heads)
    q, k, v = torch.randn(20, 4, dim), torch.randn(20, kv_heads, dim), torch.randn(20, kv_heads, dim)
    tables = torch.tensor([[0, 1]])
    meta = step_metadata(tables, [20], [20], bs, None)
    cache = torch.zeros(2, 2, bs, kv_heads, dim + 2, dtype=torch.int8)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    ReferenceAttention().forward(q, k, v, ref_cache, meta, dim**-0.5, key_feedback=fb)
    backend = CpuPagedAttention(kernels(KernelConfig(kv_layout="rows")))
    cpu_meta = backend.metadata_builder(cpu_cache, torch.float32, 4).build(meta)
    backend.forward(q, k, v, cpu_cache, cpu_meta, dim**-0.5, key_feedback=fb)
    oracle = cache.clone()
    write_rows(k, v, oracle, meta.slot_mapping, fb)
    assert torch.equal(ref_cache, oracle) and torch.equal(cpu_cache, oracle)
    with pytest.raises(ValueError, match="quantized pages"):
        ReferenceAttention().forward(q, k, v, torch.zeros(2, 2, bs, kv_heads, dim), meta, 1.0, key_feedback=fb)
    with pytest.raises(RuntimeError, match="key_feedback is for quantized pages"):
        ops.reshape_and_cache(k, v, torch.zeros(2, 2, bs, kv_heads, dim), meta.slot_mapping, False, fb)
    with pytest.raises(RuntimeError, match=r"key_feedback must be contiguous float32 \[kv_heads, head_dim"):
        ops.reshape_and_cache(k, v, cache.clone(), meta.slot_mapping, False, fb[:1])

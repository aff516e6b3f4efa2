"""The compiled kernels' other storage: AMX decode tiles, the packed bf16 layout and its conversions, and which
layout and GEMM the backend picks on which CPU."""

from __future__ import annotations

import random

import pytest
import torch

from kvpage.attention.backends.cpu import CpuPagedAttention
from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.envs import KernelConfig
from kvpage.ops import PARTITION_SIZE, kernels, load_kernels, pack_kv_rows, unpack_kv_rows
from tests.helpers.kernels import have_cxx
from tests.helpers.paged_cases import LAYOUTS, dense_reference, make_case, make_decode_case

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (16, 4, 128), (6, 6, 64), (24, 3, 64)])
def test_amx_decode_matches_reference_and_the_avx512_kernel(block_size, heads, kv_heads, dim):
    """Where the CPU and OS grant AMX, decode tasks use tile products (three phases per partition); the
    AVX-512 kernel stays the fallback. Both must agree with a dense float32 reference, with NaN in every
    slot past the contexts (partial tiles), for GQA groups 1-8, partitions of 512 and 64 keys (AMX) and 17
    keys (not a multiple of 16: the AVX-512 kernel), and a batch of 12 sequences (contexts not split: the
    AVX-512 kernel, which streams many sequences' KV from memory faster)."""
    ops = load_kernels()
    if not ops.amx_decode_available():
        pytest.skip("AMX tile products unavailable on this CPU/OS")
    rng = random.Random(block_size + heads + dim)
    differs = False
    for num_seqs in (1, 4, 12):
        q, cache, tables, qsl, lens = make_decode_case(rng, block_size, heads, kv_heads, dim, num_seqs)
        ref = dense_reference(q, cache, tables, lens, dim**-0.5)
        for part in (PARTITION_SIZE, 64, 17):
            # the last argument: KernelConfig.amx_decode
            amx = ops.paged_attention(q, cache, tables, qsl, lens, dim**-0.5, part, False, True, True)
            avx = ops.paged_attention(q, cache, tables, qsl, lens, dim**-0.5, part, False, True, False)
            torch.testing.assert_close(amx.float(), ref, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(avx.float(), ref, rtol=1e-2, atol=1e-2)
            differs |= not torch.equal(amx, avx)
    assert differs, "the AMX path was never taken (its results equal the AVX-512 kernel's bit for bit)"


def poison_unwritten(cache: torch.Tensor, tables: torch.Tensor, seq_lens: list[int]) -> None:
    """NaN in every slot no sequence has written (past each context, and blocks no table holds)."""
    written = torch.zeros(cache.shape[1] * cache.shape[2], dtype=torch.bool)
    bs = cache.shape[2]
    for i, ctx in enumerate(seq_lens):
        for p in range(ctx):
            written[int(tables[i, p // bs]) * bs + p % bs] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~written] = float("nan")


@pytest.mark.parametrize("block_size", [16, 32, 48])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (8, 1, 128), (4, 4, 64), (16, 2, 64), (8, 1, 64), (5, 5, 64), (24, 3, 64),
                          (4, 1, 256), (8, 2, 256)])
@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_layout_matches_reference(block_size, heads, kv_heads, dim, long, layout):
    """bf16 caches in the packed layout: the slot write puts every new K/V element where pack_kv_rows says,
    and attention (decode, chunks after a cached prefix, whole prompts; masked tails with NaN in every
    never-written slot; GQA groups 1-8; partitions that cut contexts) matches the reference, with decode tasks
    on the AVX-512 kernel and on AMX products (which must actually run where granted): the all-rows kernel
    for head size 64 and up to 16 query heads, with odd KV head counts (a value tile spans both groups of a
    step) and a single KV head, the per-head kernel otherwise."""
    ops = load_kernels()
    if not ops.has_packed_layout():
        pytest.skip("this build has no packed layout (no AVX512-BF16)")
    rng = random.Random(block_size * 1000 + heads * 10 + dim + long)
    for _ in range(3):
        q, k, v, cache, meta = make_case(rng, block_size, heads, kv_heads, dim, torch.bfloat16, torch.bfloat16,
                                         long=long)
        poison_unwritten(cache, meta.block_tables, meta.seq_lens.tolist())
        # the slots this step writes start as NaN too, so the check below sees every element land
        cache.view(2, -1, *cache.shape[3:])[:, meta.slot_mapping] = float("nan")
        ref_cache = cache.clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, dim**-0.5)
        packed = LAYOUTS[layout](pack_kv_rows(cache))
        ops.reshape_and_cache(k, v, packed, meta.slot_mapping, True)
        written = unpack_kv_rows(packed).reshape(2, -1, kv_heads, dim)[:, meta.slot_mapping]
        assert torch.equal(written, ref_cache.view(2, -1, kv_heads, dim)[:, meta.slot_mapping])
        for part in (PARTITION_SIZE, 64) if long else (PARTITION_SIZE,):
            for amx in (False, True):  # decode tasks: AVX-512, then AMX where the CPU and OS grant it
                out = ops.paged_attention(q, packed, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                          dim**-0.5, part, True, True, amx)
                expect = ("avx512-packed" if not (amx and ops.amx_decode_available() and heads // kv_heads <= 16)
                          else "amx-pairs" if dim == 64 and heads <= 16 else "amx-packed")
                assert ops.last_decode_kernel() == expect
                assert not out.isnan().any()
                torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_decode_rescales_when_scores_climb():
    """Keys that line up ever more with their queries make each row's maximum climb by ~50 over a context,
    with a spike near the end: the all-rows AMX kernel's output must follow every rise of the maximum (it
    rescales its accumulator tiles only for rises of more than 8, so random data alone would never test it)."""
    ops = load_kernels()
    if not ops.has_packed_layout():
        pytest.skip("this build has no packed layout (no AVX512-BF16)")
    rng = random.Random(7)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    g = heads // kv_heads
    q, cache, tables, qsl, lens = make_decode_case(rng, bs, heads, kv_heads, dim, 6)
    for i, ctx in enumerate(lens.tolist()):
        for h in range(kv_heads):
            direction = q[i, h * g : (h + 1) * g].float().mean(0)
            direction /= direction.norm()
            for p in range(ctx):
                climb = 90.0 * p / ctx + (60.0 if p == ctx - 3 else 0.0)
                key = torch.randn(dim) * 0.3 + direction * climb
                cache[0, tables[i, p // bs], p % bs, h] = key.bfloat16()
    ref = dense_reference(q, cache, tables, lens, dim**-0.5)
    for part in (PARTITION_SIZE, 64):
        out = ops.paged_attention(q, pack_kv_rows(cache), tables, qsl, lens, dim**-0.5, part, True)
        if ops.amx_decode_available():
            assert ops.last_decode_kernel() == "amx-pairs"
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_packed_layout_conversions_invert_each_other():
    rows = torch.randn(2, 5, 32, 3, 64).bfloat16()
    packed = pack_kv_rows(rows)
    assert torch.equal(unpack_kv_rows(packed), rows) and not torch.equal(packed, rows)
    # K: dim pair p of the 16 keys of group 0, head 0, is one contiguous stretch of 32 elements
    assert torch.equal(packed[0, 0].flatten()[5 * 32 : 6 * 32].view(16, 2), rows[0, 0, :16, 0, 10:12])


def test_packed_layout_rejects_what_it_cannot_hold():
    ops = load_kernels()
    if not ops.has_packed_layout():
        pytest.skip("this build has no packed layout (no AVX512-BF16)")
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="bfloat16, int8 or fp8 only"):
        ops.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), torch.zeros(2, 4, 16, 2, 64), one, True)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cache = torch.zeros(2, 4, 8, 2, 64, dtype=torch.bfloat16)
        ops.reshape_and_cache(torch.zeros(1, 2, 64).bfloat16(), torch.zeros(1, 2, 64).bfloat16(), cache, one, True)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    args = (cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="bfloat16 queries"):
        ops.paged_attention(torch.zeros(1, 4, 64), *args, 512, True)
    with pytest.raises(RuntimeError, match="multiple of 16 keys"):
        ops.paged_attention(torch.zeros(1, 4, 64).bfloat16(), *args, 17, True)


def test_backend_packs_bf16_caches_and_keeps_rows_otherwise():
    backend = CpuPagedAttention(kernels(KernelConfig(kv_layout="packed")))
    if not load_kernels().has_packed_layout():
        pytest.skip("this build has no packed layout (no AVX512-BF16)")
    bf16 = torch.zeros(2, 4, 16, 3, 64, dtype=torch.bfloat16)
    assert backend.packed_layout(bf16, torch.bfloat16)
    assert not backend.packed_layout(bf16, torch.float32)  # float32 activations over a bf16 cache: rows
    assert not backend.packed_layout(bf16.float(), torch.float32)
    assert not backend.packed_layout(torch.zeros(2, 4, 8, 3, 64, dtype=torch.bfloat16), torch.bfloat16)
    assert backend.packed_layout(torch.zeros(2, 4, 16, 1, 256, dtype=torch.bfloat16), torch.bfloat16)
    assert not backend.packed_layout(torch.zeros(2, 4, 16, 3, 32, dtype=torch.bfloat16), torch.bfloat16)
    assert not CpuPagedAttention(kernels(KernelConfig(kv_layout="rows"))).packed_layout(bf16, torch.bfloat16)


ALL = 1 << 62


@pytest.mark.parametrize(("vendor", "family", "setting", "expected"), [
    ("GenuineIntel", "6", "auto", ALL), ("AuthenticAMD", "26", "auto", 0), ("AuthenticAMD", "25", "auto", 48),
    ("AuthenticAMD", "26", "1", ALL), ("AuthenticAMD", "25", "0", 0), ("GenuineIntel", "6", "0", 0)])
def test_int8_gemm_auto_follows_the_measurements(monkeypatch, vendor, family, setting, expected):
    """`auto` takes the int8 GEMM at every row count on Intel CPUs, up to 48 rows on AMD's Zen 4 (family 25) and
    never on Zen 5 (family 26), where oneDNN's bf16 GEMM is faster; 1 and 0 force either, and a build without it
    never claims it."""
    import importlib

    kernels_mod = importlib.import_module("kvpage.ops.kernels")  # the module (kvpage.ops.kernels is also a function)

    class Build:  # what Kernels asks of the compiled module
        def __init__(self, has_i8: bool) -> None:
            self.has_i8 = has_i8

        def __getattr__(self, name):
            return lambda: self.has_i8 if name == "i8_gemm_available" else False

    monkeypatch.setattr(kernels_mod, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(kernels_mod, "cpuinfo_field", lambda name: family if name == "cpu family" else "")
    config = KernelConfig(i8_gemm=setting)
    bound = kernels_mod.Kernels(Build(True), config)
    assert bound.i8_max_rows == expected and bound.i8_gemm_ok is (expected > 0)
    assert kernels_mod.Kernels(Build(False), config).i8_gemm_ok is False
    with pytest.raises(ValueError, match="i8_gemm"):
        KernelConfig(i8_gemm=True)  # the old boolean form is refused by name


@pytest.mark.parametrize(("vendor", "family", "setting", "bf16", "int8", "fp8"), [
    ("GenuineIntel", "6", "auto", True, True, False), ("AuthenticAMD", "26", "auto", False, False, False),
    ("AuthenticAMD", "25", "auto", False, True, True), ("AuthenticAMD", "26", "packed", True, True, True),
    ("AuthenticAMD", "25", "rows", False, False, False), ("GenuineIntel", "6", "rows", False, False, False)])
def test_kv_layout_auto_follows_the_measurements(monkeypatch, vendor, family, setting, bf16, int8, fp8):
    """`auto` packs bf16 and int8 pages on Intel CPUs (fp8 rows there: AMX tiles read them), int8 and fp8 pages
    on AMD's Zen 4 (family 25) and none on Zen 5 (family 26), where the row loops stream long contexts faster;
    packed and rows force either; a build without the packed kernels never claims them."""
    import importlib

    kernels_mod = importlib.import_module("kvpage.ops.kernels")

    class Build:  # a build with (or without) both packed layouts
        def __init__(self, has: bool) -> None:
            self.has = has

        def __getattr__(self, name):
            return lambda: self.has if name in ("has_packed_layout", "has_packed_int8_layout") else False

    monkeypatch.setattr(kernels_mod, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(kernels_mod, "cpuinfo_field", lambda name: family if name == "cpu family" else "")
    config = KernelConfig(kv_layout=setting)
    ops = kernels_mod.Kernels(Build(True), config)
    assert ops.packed_layout is bf16 and ops.packed_int8_layout is int8 and ops.packed_fp8_layout is fp8
    assert ops.avx2_row_decode is (vendor == "AuthenticAMD")  # bf16 rows decode on the AVX2 loop where rows pay
    ops = kernels_mod.Kernels(Build(False), config)
    assert not (ops.packed_layout or ops.packed_int8_layout or ops.packed_fp8_layout)
    with pytest.raises(ValueError, match="kv_layout"):
        KernelConfig(kv_layout="pack")


def test_backend_packs_int8_and_fp8_pages_where_the_build_has_vnni():
    backend = CpuPagedAttention(kernels(KernelConfig(kv_layout="packed")))
    int8 = torch.zeros(2, 4, 16, 3, 66, dtype=torch.int8)
    has = load_kernels().has_packed_int8_layout()
    rows = CpuPagedAttention(kernels(KernelConfig(kv_layout="rows")))
    for pages in (int8, int8.view(torch.float8_e4m3fn), int8.view(torch.float8_e5m2)):
        assert backend.packed_layout(pages, torch.float32) == has  # any activation dtype: the kernel takes q
        assert backend.packed_layout(pages, torch.bfloat16) == has
        assert not backend.prompts_read_cache(pages, torch.bfloat16)  # the AMX prompt kernel reads bf16 only
        assert not rows.packed_layout(pages, torch.bfloat16)
    assert not backend.packed_layout(torch.zeros(2, 4, 8, 3, 66, dtype=torch.int8), torch.bfloat16)
    assert not backend.packed_layout(torch.zeros(2, 4, 16, 3, 82, dtype=torch.int8), torch.bfloat16)

"""The compiled CPU kernels against the reference backend: random shapes, block sizes, ragged lengths,
GQA ratios, float32, bfloat16 and float16 caches, contexts longer than one partition."""

from __future__ import annotations

import random

import pytest
import torch

from kvpage.attention.backends.cpu import CpuPagedAttention
from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.attention.metadata import AttentionMetadata
from kvpage.envs import KernelConfig
from kvpage.ops import PARTITION_SIZE, kernels, kernels_error, load_kernels, pack_kv_rows, unpack_kv_rows
from kvpage.worker.kv_cache import as_block_major
from tests.helpers.kernels import have_cxx, scatter_tables, step_metadata

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


def test_kernels_build_where_a_compiler_exists():
    assert load_kernels() is not None, kernels_error()


def make_case(rng: random.Random, block_size: int, heads: int, kv_heads: int, dim: int, kv_dtype, q_dtype,
              long: bool = False):
    num_seqs = rng.randint(1, 4)
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        ctx = rng.randint(1, PARTITION_SIZE + 300 if long else 90)
        q_len = rng.choice([1, 1, min(ctx, rng.randint(1, 24)), ctx])  # decode, chunk after prefix, whole prompt
        q_lens.append(q_len)
        seq_lens.append(ctx)
    blocks_per_seq = [-(-c // block_size) for c in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    tables = scatter_tables(rng, blocks_per_seq, list(range(num_blocks)))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim).to(kv_dtype)
    total = sum(q_lens)
    q = torch.randn(total, heads, dim).to(q_dtype)
    k = torch.randn(total, kv_heads, dim).to(q_dtype)
    v = torch.randn(total, kv_heads, dim).to(q_dtype)
    return q, k, v, cache, step_metadata(tables, q_lens, seq_lens, block_size)


LAYOUTS = {"contiguous": torch.Tensor.clone, "block_major": as_block_major}


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (9, 3, 64), (8, 1, 128), (6, 2, 32)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_matches_reference_fp32(block_size, heads, kv_heads, dim, layout):
    """Both storage orders the kernels take: a plain contiguous [2, blocks, ...] tensor and the engine's
    block-major view (a block's K and V adjacent)."""
    rng = random.Random(block_size * 100 + heads * 10 + dim)
    ops = load_kernels()
    for _ in range(3):
        q, k, v, cache, meta = make_case(rng, block_size, heads, kv_heads, dim, torch.float32, torch.float32)
        ref_cache, ker_cache = cache.clone(), LAYOUTS[layout](cache)
        ref = ReferenceAttention().forward(q, k, v, ref_cache, meta, dim**-0.5)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        assert torch.equal(ker_cache, ref_cache), "the slot write must be exact"
        out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, dim**-0.5,
                                  PARTITION_SIZE)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("kv_dtype", "q_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                                   (torch.float16, torch.bfloat16)])
def test_kernel_bf16_paths(kv_dtype, q_dtype):
    rng = random.Random(7)
    ops = load_kernels()
    for _ in range(4):
        q, k, v, cache, meta = make_case(rng, 16, 9, 3, 64, kv_dtype, q_dtype)
        ref_cache, ker_cache = cache.clone(), cache.clone()
        # The reference upcasts to float32 here so both compute in float32 from the same bf16 inputs.
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, 0.125)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        assert torch.equal(ker_cache, ref_cache)
        out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125,
                                  PARTITION_SIZE)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 1, 128), (4, 4, 64)])
@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_half_size_cache_vectorized_path_matches_reference(block_size, heads, kv_heads, dim, long, layout, q_dtype,
                                                           kv_dtype):
    """A bf16 or float16 cache with head size 64/128 takes a vectorized path: every block size (chunks shorter
    and longer than 16 keys), masked tails, GQA groups and context partitions that cut blocks. On AVX2 builds
    that is the row kernel widening 16-bit values to float32 in registers (named avx2-bf16 / avx2-f16), for bf16
    and float32 queries alike; with float32 queries it computes exactly what the reference does in float32 on
    the same rounded cache, so the tolerance is float32's."""
    rng = random.Random(block_size * 1000 + heads * 10 + dim + long)
    ops = load_kernels()
    exact = q_dtype == torch.float32
    for _ in range(3):
        q, k, v, cache, meta = make_case(rng, block_size, heads, kv_heads, dim, kv_dtype, q_dtype, long=long)
        ref_cache, ker_cache = cache.clone(), LAYOUTS[layout](cache)
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, dim**-0.5)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        for part in (PARTITION_SIZE, 17) if long else (PARTITION_SIZE,):
            out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                      dim**-0.5, part)
            if ops.f32_gemm_available():  # an AVX2 + FMA build without AVX-512
                assert ops.last_decode_kernel() == {torch.bfloat16: "avx2-bf16", torch.float16: "avx2-f16"}[kv_dtype]
            if exact:
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
            else:
                torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_long_contexts_split_into_partitions():
    rng = random.Random(3)
    ops = load_kernels()
    for _ in range(3):
        q, k, v, cache, meta = make_case(rng, 16, 8, 2, 64, torch.float32, torch.float32, long=True)
        ref_cache, ker_cache = cache.clone(), cache.clone()
        ref = ReferenceAttention().forward(q, k, v, ref_cache, meta, 0.125)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        for part in (PARTITION_SIZE, 64, 17):
            out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125,
                                      part)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_stream_splits_its_context_over_the_threads(threads, block_size, dtype):
    """Fewer decode sequences than threads (one stream): contexts shorter than a partition are cut into one
    part per thread (at least 64 keys, multiples of 16, cuts inside blocks for odd block sizes) and merged;
    results match the dense reference at every context length around the cuts."""
    ops = load_kernels()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(block_size)
        for ctx in (1, 63, 64, 65, 127, 129, 200, 333):
            nblocks = -(-ctx // block_size)
            cache = torch.full((2, nblocks + 3, block_size, 2, 64), float("nan"), dtype=dtype)
            table = torch.randperm(nblocks + 3, generator=g)[:nblocks]
            for p in range(ctx):
                cache[:, table[p // block_size], p % block_size] = torch.randn(2, 2, 64, generator=g).to(dtype)
            q_dtype = torch.float32 if dtype == torch.float16 else dtype  # float16 is a cache dtype only
            q = torch.randn(1, 6, 64, generator=g).to(q_dtype)
            tables, lens = table[None].clone(), torch.tensor([ctx])
            ref = dense_reference(q, cache, tables, lens, 0.125)
            tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            for split in (True, False):  # KernelConfig.split_short: both ways give the reference
                out = ops.paged_attention(q, cache, tables, torch.arange(2), lens, 0.125, PARTITION_SIZE, False, split)
                torch.testing.assert_close(out.float(), ref, **tol)
    finally:
        torch.set_num_threads(before)


def test_kernel_rejects_bad_input():
    ops = load_kernels()
    cache = torch.zeros(2, 4, 16, 2, 8)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        ops.reshape_and_cache(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), cache, torch.tensor([64]))
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.paged_attention(torch.zeros(1, 3, 8), cache, torch.zeros(1, 1, dtype=torch.long),
                            torch.tensor([0, 1]), torch.tensor([1]), 1.0, 512)
    q, table = torch.zeros(3, 2, 8), torch.tensor([[0, 1], [2, 3]])
    bad_batches = [  # (query_start_loc, seq_lens, block_tables, error): each would read outside query or cache
        (torch.tensor([0, 1]), torch.tensor([1, 2]), table, "seqs \\+ 1"),
        (torch.tensor([0, 1, 2]), torch.tensor([1, 2]), table, "from 0 to the 3 query rows"),
        (torch.tensor([0, 2, 1, 3]), torch.tensor([2, 1, 1]), torch.zeros(3, 1, dtype=torch.long), "decreases"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 1]), table, "fewer keys"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 40]), table, "more blocks than its table row"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 20]), torch.tensor([[0, 1], [2, 4]]), "block 4 outside"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 20]), table[:1], "a row per sequence"),
        (torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([1, 20]), table, "int64 tensor of seqs"),
    ]
    for qsl, lens, tables, error in bad_batches:
        with pytest.raises(RuntimeError, match=error):
            ops.paged_attention(q, cache, tables, qsl, lens, 1.0, 512)
    ops.paged_attention(q, cache, table, torch.tensor([0, 1, 3]), torch.tensor([1, 20]), 1.0, 512)  # the valid one
    # cache dtypes the kernels do not read: refused by name, not misread; an int8 cache without its rows' scales
    # (head_dim + 2 bytes) is refused by its width
    for bad, error in ((torch.float64, "kv_cache must be float32, bfloat16, float16, int8"),
                       (torch.int8, "head_dim of query and cache differ")):
        with pytest.raises(RuntimeError, match=error):
            ops.paged_attention(q, cache.to(bad), table, torch.tensor([0, 1, 3]), torch.tensor([1, 20]), 1.0, 512)
    one = (torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(RuntimeError, match="dense"):  # a block's interior must be [block_size, heads, dim]
        ops.reshape_and_cache(*one, torch.zeros(2, 4, 2, 16, 8).transpose(2, 3), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="block-major"):  # blocks 3 apart: neither storage order
        ops.reshape_and_cache(*one, torch.zeros(4, 3, 16, 2, 8)[:, :2].transpose(0, 1), torch.tensor([0]))


def make_decode_case(rng: random.Random, block_size: int, heads: int, kv_heads: int, dim: int, num_seqs: int):
    """Decode only (one query per sequence), ragged contexts, some longer than one partition."""
    seq_lens = [rng.randint(1, 1300) for _ in range(num_seqs)]
    blocks_per_seq = [-(-c // block_size) for c in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    tables = scatter_tables(rng, blocks_per_seq, list(range(num_blocks)))
    # Slots past each context hold NaN: the kernel must never let them into a result.
    cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=torch.bfloat16)
    for i, ctx in enumerate(seq_lens):
        for p in range(ctx):
            cache[:, tables[i, p // block_size], p % block_size] = torch.randn(2, kv_heads, dim).bfloat16()
    q = torch.randn(len(seq_lens), heads, dim).bfloat16()
    return q, cache, tables, torch.arange(len(seq_lens) + 1), torch.tensor(seq_lens)


def dense_reference(q, cache, tables, seq_lens, scale):
    out = []
    g = q.shape[1] // cache.shape[3]
    for i, ctx in enumerate(seq_lens.tolist()):
        rows = tables[i, : -(-ctx // cache.shape[2])]
        k = cache[0, rows].flatten(0, 1)[:ctx].float().repeat_interleave(g, dim=1)  # [ctx, heads, dim]
        v = cache[1, rows].flatten(0, 1)[:ctx].float().repeat_interleave(g, dim=1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[i].float(), k) * scale, dim=-1)
        out.append(torch.einsum("hk,khd->hd", w, v))
    return torch.stack(out)


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
                         [(9, 3, 64), (8, 1, 128), (4, 4, 64), (16, 2, 64), (8, 1, 64), (5, 5, 64), (24, 3, 64)])
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
    with pytest.raises(RuntimeError, match="bfloat16 \\(or int8\\) only"):
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
    assert not backend.packed_layout(torch.zeros(2, 4, 16, 3, 32, dtype=torch.bfloat16), torch.bfloat16)
    assert not CpuPagedAttention(kernels(KernelConfig(kv_layout="rows"))).packed_layout(bf16, torch.bfloat16)


@pytest.mark.parametrize(("vendor", "setting", "expected"), [
    ("GenuineIntel", "auto", True), ("AuthenticAMD", "auto", False), ("AuthenticAMD", "1", True),
    ("GenuineIntel", "0", False)])
def test_int8_gemm_auto_follows_the_measurements(monkeypatch, vendor, setting, expected):
    """`auto` takes the int8 GEMM on Intel CPUs only (on AMD's Zen 5 oneDNN's bf16 GEMM is faster); 1 and 0
    force either, and a build without it never claims it."""
    import importlib

    kernels_mod = importlib.import_module("kvpage.ops.kernels")  # the module (kvpage.ops.kernels is also a function)

    class Build:  # what Kernels asks of the compiled module
        def __init__(self, has_i8: bool) -> None:
            self.has_i8 = has_i8

        def __getattr__(self, name):
            return lambda: self.has_i8 if name == "i8_gemm_available" else False

    monkeypatch.setattr(kernels_mod, "cpu_vendor", lambda: vendor)
    config = KernelConfig(i8_gemm=setting)
    assert kernels_mod.Kernels(Build(True), config).i8_gemm_ok is expected
    assert kernels_mod.Kernels(Build(False), config).i8_gemm_ok is False
    with pytest.raises(ValueError, match="i8_gemm"):
        KernelConfig(i8_gemm=True)  # the old boolean form is refused by name


@pytest.mark.parametrize(("vendor", "setting", "expected"), [
    ("GenuineIntel", "auto", True), ("AuthenticAMD", "auto", False), ("AuthenticAMD", "packed", True),
    ("GenuineIntel", "rows", False)])
def test_kv_layout_auto_follows_the_measurements(monkeypatch, vendor, setting, expected):
    """`auto` packs bf16 and int8 pages on Intel CPUs and keeps rows on AMD's (where the row loops stream long
    contexts faster); packed and rows force either; a build without the packed kernels never claims them."""
    import importlib

    kernels_mod = importlib.import_module("kvpage.ops.kernels")

    class Build:  # a build with (or without) both packed layouts
        def __init__(self, has: bool) -> None:
            self.has = has

        def __getattr__(self, name):
            return lambda: self.has if name in ("has_packed_layout", "has_packed_int8_layout") else False

    monkeypatch.setattr(kernels_mod, "cpu_vendor", lambda: vendor)
    config = KernelConfig(kv_layout=setting)
    ops = kernels_mod.Kernels(Build(True), config)
    assert ops.packed_layout is expected and ops.packed_int8_layout is expected
    assert ops.avx2_row_decode is (vendor == "AuthenticAMD")  # bf16 rows decode on the AVX2 loop where rows pay
    ops = kernels_mod.Kernels(Build(False), config)
    assert ops.packed_layout is False and ops.packed_int8_layout is False
    with pytest.raises(ValueError, match="kv_layout"):
        KernelConfig(kv_layout="pack")


def test_backend_packs_int8_pages_where_the_build_has_vnni():
    backend = CpuPagedAttention(kernels(KernelConfig(kv_layout="packed")))
    int8 = torch.zeros(2, 4, 16, 3, 66, dtype=torch.int8)
    has = load_kernels().has_packed_int8_layout()
    assert backend.packed_layout(int8, torch.float32) == has  # any activation dtype: the kernel quantizes q
    assert backend.packed_layout(int8, torch.bfloat16) == has
    assert not backend.prompts_read_cache(int8, torch.bfloat16)  # the AMX prompt kernel reads bf16 only
    assert not backend.packed_layout(torch.zeros(2, 4, 8, 3, 66, dtype=torch.int8), torch.bfloat16)
    assert not backend.packed_layout(torch.zeros(2, 4, 16, 3, 82, dtype=torch.int8), torch.bfloat16)
    assert not backend.packed_layout(int8.view(torch.float8_e4m3fn), torch.bfloat16)
    assert not CpuPagedAttention(kernels(KernelConfig(kv_layout="rows"))).packed_layout(int8, torch.bfloat16)
    assert backend.packs_windows(int8) == has  # the packed int8 loop takes sliding windows, bf16's do not
    assert not backend.packs_windows(torch.zeros(2, 4, 16, 3, 64, dtype=torch.bfloat16))


def test_orphaned_build_lock_is_removed_and_a_live_build_waited_for(tmp_path, monkeypatch, caplog):
    """A process killed during a build leaves torch's lock file behind, and torch would wait for it forever;
    a live build holds the flock, and a second process waits for it (and only for it)."""
    import fcntl
    import subprocess
    import sys

    import torch.utils.cpp_extension as cpp

    from kvpage.ops import build

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    (tmp_path / "lock").touch()  # torch's file, its writer gone
    with build._build_lock("x"):
        assert not (tmp_path / "lock").exists() and "orphaned kernel build lock" in caplog.text
        # a live holder: another process cannot take the flock until this one lets go
        probe = ("import fcntl, sys; f = open(sys.argv[1], 'w')\n"
                 "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)")
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "kvpage.flock")], check=False)
        assert held.returncode == 3
    with open(tmp_path / "kvpage.flock") as f:  # released on exit
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    # a holder that dies without letting go: the kernel drops its lock, so the next build goes ahead
    subprocess.run([sys.executable, "-c", "import fcntl, os, sys; f = open(sys.argv[1], 'w'); "
                    "fcntl.flock(f, fcntl.LOCK_EX); open(sys.argv[2], 'w'); os._exit(9)",
                    str(tmp_path / "kvpage.flock"), str(tmp_path / "lock")], check=False)
    with build._build_lock("x"):
        assert not (tmp_path / "lock").exists()


@pytest.mark.parametrize("kv_layout", ["packed", "rows"])
def test_cpu_metadata_is_built_once_per_step_and_serves_every_layer(kv_layout):
    """The CPU backend's builder splits the step (decodes and short chunks for the paged kernel, long chunks
    after cached keys, whole fresh prompts) and plans the paged kernel's tasks once; every layer's forward then
    consumes that metadata, and equals the reference backend on each layer's own cache."""
    ops = kernels(KernelConfig(kv_layout=kv_layout, paged_prompts=False))
    backend = CpuPagedAttention(ops)
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    # runner order: decodes and short chunks, then long chunks after cached keys, then fresh prompts
    q_lens, seq_lens = [1, 1, 3, 70, 80], [40, 300, 20, 100, 80]
    blocks = [-(-c // bs) for c in seq_lens]
    num_blocks = sum(blocks) + 2
    tables = torch.zeros(len(q_lens), max(blocks), dtype=torch.long)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.arange(at, at + n)
        at += n
    slots, qsl = [], [0]
    for i, (ql, ctx) in enumerate(zip(q_lens, seq_lens, strict=True)):
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(ctx - ql, ctx)]
        qsl.append(qsl[-1] + ql)
    common = AttentionMetadata(torch.tensor(slots), tables, torch.tensor(qsl), torch.tensor(seq_lens), bs, q_lens,
                               seq_lens)
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, num_blocks, bs, kv_heads, dim, generator=g).bfloat16() for _ in range(3)]
    builder = backend.metadata_builder(caches[0], torch.bfloat16, heads)
    meta = builder.build(common)
    assert meta.paged_seqs == 3 and meta.paged_rows == 5
    assert meta.cached_prefills == ((5, 70),) and meta.fresh_prefills == ((75, 80),) and not meta.decode_only
    assert meta.plan.num_rows == 5 and meta.plan.num_heads == heads and meta.plan.num_tasks >= 3
    assert meta.packed == (kv_layout == "packed" and ops.packed_layout)
    assert (meta.cached_plan is None) == meta.prompts_read_cache
    for cache in caches:  # one metadata, three layers
        q = torch.randn(sum(q_lens), heads, dim, generator=g).bfloat16()
        k = torch.randn(sum(q_lens), kv_heads, dim, generator=g).bfloat16()
        v = torch.randn(sum(q_lens), kv_heads, dim, generator=g).bfloat16()
        ref_cache = cache.clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, common, dim**-0.5)
        layer_cache = pack_kv_rows(cache) if meta.packed else cache.clone()
        out = backend.forward(q, k, v, layer_cache, meta, dim**-0.5)
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    # Without the AMX prompt kernel (and paged_prompts on, the default) every row goes to the paged kernel.
    plain = CpuPagedAttention(kernels(KernelConfig(kv_layout=kv_layout)))
    if not plain.amx_prefill and plain.paged_prompts:
        all_paged = plain.metadata_builder(caches[0], torch.bfloat16, heads).build(common)
        assert all_paged.paged_seqs == 5 and all_paged.decode_only and all_paged.plan.num_rows == sum(q_lens)
        layer_cache = pack_kv_rows(caches[0]) if all_paged.packed else caches[0].clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), caches[0].clone(), common, dim**-0.5)
        out = plain.forward(q, k, v, layer_cache, all_paged, dim**-0.5)
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    decode = AttentionMetadata(torch.tensor(slots[:2]), tables[:2], torch.tensor(qsl[:3]), torch.tensor(seq_lens[:2]),
                               bs, q_lens[:2], seq_lens[:2])
    assert builder.build(decode).decode_only
    with pytest.raises(RuntimeError, match="the plan was checked against"):
        ops.paged_attention(torch.zeros(2, heads, dim).bfloat16(), caches[0][:, :4].contiguous(),
                            builder.build(decode).plan, 1.0, False)

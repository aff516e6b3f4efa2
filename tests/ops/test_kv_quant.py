"""Quantized KV pages (int8, fp8 e4m3, fp8 e5m2; attention/kv_quant.py): the torch oracle's round trip, the
compiled write against it byte for byte, and the compiled paged attention against the reference backend on
the same pages (decodes, prompt chunks after cached keys, whole prompts, GQA, sliding windows, partitions,
block sizes 1 to 32, head sizes 64, 128, 256 and one no loop specializes, contiguous and block-major
storage); block copies and swaps move the scales with the codes."""

from __future__ import annotations

import random

import pytest
import torch

from kvpage.attention.backends.cpu import CpuPagedAttention
from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.attention.kv_quant import QMAX, dequantize_rows, hadamard, quantize_rows, read_keys, write_rows
from kvpage.envs import KernelConfig
from kvpage.ops import kernels, load_kernels, pack_kv_rows, unpack_kv_rows
from kvpage.worker.kv_cache import as_block_major
from tests.helpers.kernels import have_cxx, scatter_tables, step_metadata

CODES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# worst error of one value against its row's absmax: int8 half a step (the scale rounded up by < 2^-7 widens it),
# fp8 half an ulp of its 3 (e4m3) or 2 (e5m2) mantissa bits
REL = {torch.int8: 0.5 / 127 * (1 + 2**-7), torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}

# fp8 decode on the dpbf16 loop against AMX bf16 tiles: the same bf16 codes and queries, weights rounded to bf16 from
# softmax steps of 16 against 64 keys (so a dominant weight may round the other way: 2^-9 each), sums in other orders
FP8_PATHS = 1e-2

needs_cxx = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


@pytest.mark.parametrize("dtype", CODES)
def test_round_trip_error_is_bounded_by_the_row_scale(dtype):
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0
    rows = quantize_rows(x, dtype)
    assert rows.shape == (50, 3, 66) and rows.dtype == dtype
    back = dequantize_rows(rows)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert ((back - x).abs() <= REL[dtype] * amax * (1 + 2**-7) + 1e-30).all()
    assert (back[0, 0] == 0).all()
    scale = rows.view(torch.uint8)[..., -2:].contiguous().view(torch.bfloat16).float()
    exact = amax / QMAX[dtype]
    assert (scale >= exact).all() and (scale <= exact * (1 + 2**-7)).all()  # rounded up to a bfloat16


def test_keys_are_stored_rotated_and_read_back_in_the_model_basis():
    """An outlier channel no longer sets the whole row's scale: the rotated row's error is far below the plain
    row's, and read_keys undoes the rotation."""
    x = torch.randn(200, 2, 64)
    x[..., 5] *= 40  # one large channel, as RoPE'd keys have
    plain = (dequantize_rows(quantize_rows(x, torch.int8)) - x).pow(2).mean()
    rotated = (read_keys(quantize_rows(hadamard(x), torch.int8)) - x).pow(2).mean()
    assert rotated < plain / 2
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-4)


@needs_cxx
@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_compiled_write_equals_the_torch_oracle_byte_for_byte(dtype, src):
    ops = load_kernels()
    torch.manual_seed(0)
    cache = torch.zeros(2, 6, 16, 3, 66, dtype=torch.uint8).view(dtype)
    key = (torch.randn(40, 3, 64) * 3).to(src)
    value = (torch.randn(40, 3, 64) * 0.01).to(src)
    key[5] = 0.0
    slots = torch.randperm(96)[:40]
    ours = as_block_major(cache.clone())
    ops.reshape_and_cache(key, value, ours, slots, False)
    oracle = cache.clone()
    write_rows(key, value, oracle, slots)
    assert torch.equal(ours.view(torch.uint8), oracle.view(torch.uint8))


def quant_case(rng: random.Random, dtype, block_size: int, heads: int, kv_heads: int, dim: int,
               window: int | None, q_dtype):
    num_seqs = rng.randint(1, 5)
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        ctx = rng.randint(1, 200)
        q_lens.append(rng.choice([1, 1, min(ctx, rng.randint(2, 40)), ctx]))
        seq_lens.append(ctx)
    blocks_per_seq = [-(-c // block_size) for c in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    tables = scatter_tables(rng, blocks_per_seq, list(range(1, num_blocks)))
    cache = quantize_rows(torch.randn(2, num_blocks, block_size, kv_heads, dim) * 2, dtype)
    total = sum(q_lens)
    q = torch.randn(total, heads, dim).to(q_dtype)
    k = torch.randn(total, kv_heads, dim).to(q_dtype)
    v = torch.randn(total, kv_heads, dim).to(q_dtype)
    return q, k, v, cache, step_metadata(tables, q_lens, seq_lens, block_size, window)


@needs_cxx
@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize(("dim", "block_size"), [(64, 16), (64, 1), (64, 32), (128, 8), (256, 16), (80, 16)])
def test_compiled_attention_matches_the_reference_on_quantized_pages(dtype, dim, block_size):
    ops = load_kernels()
    rng = random.Random(dim * 31 + block_size + len(str(dtype)))
    torch.manual_seed(dim * 31 + block_size)  # the pages' and queries' values (unseeded, a rare case drew past tol)
    for case in range(12):  # query groups of 4, 3, 4, 5 (runs of four and one), 1, 2
        window = [None, None, 1, 24][case % 4]
        heads, kv_heads = [(8, 2), (9, 3), (4, 1), (10, 2), (6, 6), (8, 4)][case % 6]
        q_dtype = torch.float32 if case % 2 else torch.bfloat16
        q, k, v, cache, meta = quant_case(rng, dtype, block_size, heads, kv_heads, dim, window, q_dtype)
        scale = dim**-0.5
        ref_cache = cache.clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, scale)
        ours = as_block_major(cache.clone()) if case % 2 else cache.clone()
        ops.reshape_and_cache(k, v, ours, meta.slot_mapping, False)
        # what the kernel wrote equals what the reference wrote (bf16 keys quantize from the same values)
        assert torch.equal(ours.contiguous().view(torch.uint8), ref_cache.view(torch.uint8))
        for part in (512, 16):
            plan = ops.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, heads, cache.shape[1],
                                      block_size, part, True, window or 0)
            outs = {}
            for amx in (False, True):  # decode tasks: the row loop, then (fp8) AMX bf16 tiles where granted
                out = ops.paged_attention_planned(q, ours, plan, scale, False, amx)
                outs[amx] = out.float()
                # rows are read 16 codes at a time (attention/quant_loop.h): for int8 the query rows and each
                # chunk's weights are rounded to int16, 2^-16 of their range (~1e-4 here, against the codes' own
                # 2^-8); for fp8 to bf16 (2^-9 of each value, as a bf16 cache's kernels round the query), on the
                # loop and on tiles alike; the head size no loop specializes dequantizes each block to float32
                fp8_tol = 2e-4 if dim not in (64, 128, 256) else 2e-2
                tol = (1e-3 if dtype == torch.int8 else fp8_tol) if q_dtype == torch.float32 else 2e-2
                torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
            # both fp8 paths round the same bf16 operands: within a bf16 rounding of each other
            # (bf16 outputs: plus one rounding of their own, 2^-8 relative)
            paths = FP8_PATHS if q_dtype == torch.float32 else FP8_PATHS + 2**-7
            torch.testing.assert_close(outs[True], outs[False], rtol=paths, atol=paths)
    # rows of a head size the loop is built for take it wherever AVX2 exists; fp8 decodes take AMX bf16 tiles
    # where the CPU grants them (16-key groups within a block; head sizes 64 and 128)
    if dim not in (64, 128, 256):
        expected = {"avx2-quant"}
    elif dtype == torch.int8:
        expected = {"avx2-int8-quant", "avx512-int8-quant"}
    elif ops.amx_decode_available() and block_size % 16 == 0 and dim in (64, 128):
        expected = {"amx-fp8-rows"}
    else:
        expected = {"avx2-fp8-quant", "avx512-fp8-quant"}
    assert ops.last_decode_kernel() in expected | {"generic-quant"}


@needs_cxx
@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize(("dim", "block_size"), [(64, 16), (64, 32), (128, 16), (256, 32)])
def test_packed_pages_match_the_reference(dtype, dim, block_size):
    """int8 and fp8 pages in the packed layout (ops/csrc/attention/packed_int8.h, packed_fp8.h): the slot write
    puts every code and scale where pack_kv_rows says, and the kernel over them matches the reference backend on
    the rows, sliding windows included."""
    ops = load_kernels()
    if not ops.has_packed_int8_layout():
        pytest.skip("this build has no packed int8 and fp8 layouts (AVX512-VNNI, AVX512-BF16)")
    rng = random.Random(dim + block_size + len(str(dtype)))
    for case in range(14):  # query groups of 4, 3, 4, 5, 1, 2, 8; decodes, chunks after cached keys, prompts
        heads, kv_heads = [(8, 2), (9, 3), (4, 1), (10, 2), (6, 6), (8, 4), (16, 2)][case % 7]
        q_dtype = torch.float32 if case % 2 else torch.bfloat16
        window = [None, None, 1, 24, None, 37][case % 6]  # edges inside 16-key groups, and a window of one
        q, k, v, cache, meta = quant_case(rng, dtype, block_size, heads, kv_heads, dim, window, q_dtype)
        scale = dim**-0.5
        ref_cache = cache.clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, scale)
        packed = pack_kv_rows(cache)
        ours = as_block_major(packed.clone()) if case % 2 else packed.clone()
        ops.reshape_and_cache(k, v, ours, meta.slot_mapping, True)
        assert torch.equal(unpack_kv_rows(ours.contiguous()).view(torch.uint8), ref_cache.view(torch.uint8))
        for part in (512, 16):
            plan = ops.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, heads, cache.shape[1],
                                      block_size, part, True, window or 0)
            for amx in (False, True):  # decode tasks: the VNNI loop, then AMX byte tiles where granted
                out = ops.paged_attention_planned(q, ours, plan, scale, True, amx)
                if dtype != torch.int8:
                    assert ops.last_decode_kernel() == "avx512-fp8-packed"  # AMX fp8 tiles read rows only
                    # queries and weights rounded to bf16 as on the row loop (whose own worst element here is
                    # 1.3x the rows test's 2e-2: 256 dims of bf16 queries): within a bf16 rounding of its output
                    rows = ops.paged_attention_planned(q, ref_cache, plan, scale, False, False).float()
                    paths = FP8_PATHS if q_dtype == torch.float32 else FP8_PATHS + 2**-7
                    torch.testing.assert_close(out.float(), rows, rtol=paths, atol=paths)
                    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
                    continue
                # queries as two int8 codes (~16 bits), weights x value scales as 16-bit codes per group
                tol = 1e-3 if q_dtype == torch.float32 else 2e-2
                torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
                # AMX byte tiles take query groups of up to 5 (three tile rows per query row)
                on_tiles = amx and ops.amx_int8_decode_available() and heads // kv_heads <= 5
                assert ops.last_decode_kernel() == ("amx-int8-packed" if on_tiles else "avx512-int8-packed")


@needs_cxx
@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(24, 2), (40, 2), (64, 1)])
def test_large_query_groups_match_the_reference(dtype, heads, kv_heads):
    """Query groups past 8 and 16 rows: the AVX-512 softmax step takes up to 16 rows per pass and packs two
    factors of up to 8 rows into one exp (attention/quant_loop.h block_weights16)."""
    ops = load_kernels()
    rng = random.Random(heads)
    torch.manual_seed(heads)
    for case, block_size in enumerate((16, 32, 5)):
        q_dtype = torch.float32 if case % 2 else torch.bfloat16
        q, k, v, cache, meta = quant_case(rng, dtype, block_size, heads, kv_heads, 64, None, q_dtype)
        ref_cache = cache.clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, 0.125)
        ours = cache.clone()
        ops.reshape_and_cache(k, v, ours, meta.slot_mapping, False)
        plan = ops.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, heads, cache.shape[1],
                                  block_size, 512, True, 0)
        out = ops.paged_attention_planned(q, ours, plan, 0.125, False, True)
        tol = (1e-3 if dtype == torch.int8 else 2e-2) if q_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@needs_cxx
def test_int8_weights_keep_their_precision_over_long_contexts():
    """Over 4K keys, with one key that draws much of the weight (an attention sink) and many small weights, the
    int8 loop's output stays within 7e-5 of the reference's on the same pages (median relative error per row:
    4.7e-5 with 15-bit weights scaled to each 16-key block's own largest (AVX-512 builds), 4.0e-5 with
    offset 16-bit weights over 64-key units (AVX2 builds), 7.2e-5 with 15-bit weights over 64-key units,
    9.2e-5 when scaled to the running maximum, where the small weights' rounding adds up)."""
    ops = load_kernels()
    rng = random.Random(7)
    torch.manual_seed(7)
    seqs, ctx, bs, heads, kv_heads, dim = 4, 4096, 16, 9, 3, 64
    per = ctx // bs
    tables = scatter_tables(rng, [per] * seqs, list(range(1, seqs * per + 1)))
    raw = torch.randn(2, seqs * per + 1, bs, kv_heads, dim)
    q = torch.randn(seqs, heads, dim)
    for s in range(seqs):
        for h in range(kv_heads):
            raw[0, int(tables[s, 0]), 0, h] = q[s, 3 * h:3 * h + 3].mean(0) * 6
    cache = quantize_rows(raw, torch.int8)
    k, v = torch.randn(seqs, kv_heads, dim), torch.randn(seqs, kv_heads, dim)
    meta = step_metadata(tables, [1] * seqs, [ctx] * seqs, bs, None)
    ref = ReferenceAttention().forward(q, k, v, cache.clone(), meta, dim**-0.5)
    ours = cache.clone()
    ops.reshape_and_cache(k, v, ours, meta.slot_mapping, False)
    plan = ops.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, heads, cache.shape[1], bs,
                              512, True, 0)
    out = ops.paged_attention_planned(q, ours, plan, dim**-0.5, False, True).float()
    err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert err.median() < 7e-5, err
    if ops.has_packed_int8_layout():  # the packed pages: the VNNI loop (16-key groups), AMX tiles (128-key spans)
        packed = pack_kv_rows(cache)
        ops.reshape_and_cache(k, v, packed, meta.slot_mapping, True)
        for amx in (False, True):
            out = ops.paged_attention_planned(q, packed, plan, dim**-0.5, True, amx).float()
            err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
            print(f"packed, amx={amx}: median relative error {err.median():.2e}")
            assert err.median() < 7e-5, err


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(("dim", "kv_heads", "heads"), [(64, 3, 9), (128, 2, 8)])
def test_fp8_decode_paths_keep_the_loops_precision_over_long_contexts(dtype, dim, kv_heads, heads):
    """fp8 decode on AMX bf16 tiles (attention/amx_fp8.h: 64-key softmax steps) and on the packed pages' loop
    (attention/packed_fp8.h: 16-key groups, no horizontal sums) over 4K keys with an attention sink and many
    small weights, a window edge inside a 16-key group and a context that ends inside one: as close to the
    reference on the same pages as the dpbf16 row loop (16-key steps)."""
    ops = load_kernels()
    tiles, packed = ops.amx_decode_available(), ops.has_packed_int8_layout()
    if not (tiles or packed):
        pytest.skip("neither AMX tiles nor the packed fp8 layout on this CPU, build or OS")
    rng = random.Random(dim)
    torch.manual_seed(dim)
    seqs, bs = 4, 16
    ctx = [4096, 4093, 1000, 37]
    per = max(-(-c // bs) for c in ctx)
    tables = scatter_tables(rng, [per] * seqs, list(range(1, seqs * per + 1)))
    G = heads // kv_heads
    raw = torch.randn(2, seqs * per + 1, bs, kv_heads, dim)
    q = torch.randn(seqs, heads, dim)
    for s in range(seqs):
        for h in range(kv_heads):
            raw[0, int(tables[s, 0]), 0, h] = q[s, G * h:G * h + G].mean(0) * 6
    cache = quantize_rows(raw, dtype)
    k, v = torch.randn(seqs, kv_heads, dim), torch.randn(seqs, kv_heads, dim)
    for window in (None, 1003):
        meta = step_metadata(tables, [1] * seqs, ctx, bs, window)
        ref = ReferenceAttention().forward(q, k, v, cache.clone(), meta, dim**-0.5)
        ours = cache.clone()
        ops.reshape_and_cache(k, v, ours, meta.slot_mapping, False)
        plan = ops.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, heads, cache.shape[1], bs,
                                  512, True, window or 0)
        runs = {"avx512-fp8-quant": (ours, False, False)}
        if tiles:
            runs["amx-fp8-rows"] = (ours, False, True)
        if packed:
            pages = pack_kv_rows(cache)
            ops.reshape_and_cache(k, v, pages, meta.slot_mapping, True)
            runs["avx512-fp8-packed"] = (pages, True, False)
        err = {}
        for name, (pages, is_packed, amx) in runs.items():
            out = ops.paged_attention_planned(q, pages, plan, dim**-0.5, is_packed, amx).float()
            assert ops.last_decode_kernel() == name
            err[name] = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).median().item()
        print(f"window {window}: median relative error {err}")
        # all round the query and the weights to bf16 (2^-9): ~1e-3 of the output
        loop = err.pop("avx512-fp8-quant")
        for name, e in err.items():
            assert e < 1.5 * loop + 2e-4, (name, e, loop)


@needs_cxx
@pytest.mark.parametrize("dtype,window,act", [
    (torch.int8, None, torch.bfloat16), (torch.float8_e4m3fn, None, torch.bfloat16), (torch.int8, 24, torch.bfloat16),
    (torch.int8, None, torch.float32), (torch.float8_e4m3fn, None, torch.float32)])
def test_fresh_prompts_over_quantized_pages_attend_over_their_own_kv(dtype, window, act):
    """A step with decodes, a chunk after cached keys and two whole fresh prompts over quantized pages: the
    paged rows equal the reference backend on the pages; the fresh prompts attend over their own K/V (never
    rounded to codes), on the paged kernel through a scratch cache of the activations' dtype where the backend
    takes that route (bf16 activations where the loops have bf16 dot products, float32 ones where float caches'
    fresh prompts take the paged kernel too: AVX2 builds; never beside the AMX prompt kernel), as torch's causal
    SDPA over the same K/V computes them. With a sliding window, on the AMX prompt kernel under the window where
    the CPU has it, else every row reads the pages."""
    backend = CpuPagedAttention(kernels(KernelConfig(kv_layout="rows")))
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    q_lens, seq_lens = [1, 1, 70, 80, 67], [40, 300, 100, 80, 67]
    rng = random.Random(3)
    torch.manual_seed(3)
    tables = scatter_tables(rng, [-(-c // bs) for c in seq_lens], list(range(1, 40)))
    common = step_metadata(tables, q_lens, seq_lens, bs, window)
    cache = quantize_rows(torch.randn(2, 40, bs, kv_heads, dim), dtype)
    q = torch.randn(sum(q_lens), heads, dim).to(act)
    k = torch.randn(sum(q_lens), kv_heads, dim).to(act)
    v = torch.randn(sum(q_lens), kv_heads, dim).to(act)
    meta = backend.metadata_builder(cache, act, heads, window).build(common)
    ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), cache.clone(), common, dim**-0.5)
    out = backend.forward(q, k, v, cache.clone(), meta, dim**-0.5).float()
    if window is not None and not backend.amx_prefill:
        assert meta.fresh_prefills == () and meta.cached_prefills == ()
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
        return
    assert meta.fresh_prefills == ((72, 80), (152, 67)) and meta.cached_prefills == ((2, 70),)
    paged_route = backend.paged_prompts if act == torch.bfloat16 else backend.invariant
    scratch = paged_route and not backend.amx_prefill
    assert (meta.fresh_plan is not None) == scratch
    if scratch:
        assert meta.fresh_scratch.dtype == act  # the prompts' own K/V as they came, never rounded
    if act == torch.float32 and load_kernels().f32_gemm_available():
        assert scratch  # AVX2 builds: float32 fresh prompts on the paged kernel, not one SDPA call per prompt
    torch.testing.assert_close(out[:72], ref[:72], rtol=3e-2, atol=3e-2)
    tol = 3e-2 if act == torch.bfloat16 else 1e-4  # float32 K/V and products: only summation order differs
    for start, n in meta.fresh_prefills:
        qt, kt, vt = (x[start:start + n].float().transpose(0, 1)[None] for x in (q, k, v))
        back = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        mask = (back >= 0) & (back < (window or n))
        dense = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=dim**-0.5,
                                                                 enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], dense, rtol=tol, atol=tol)


@needs_cxx
def test_quantized_pages_refuse_a_packed_layout_they_lack_and_a_wrong_width():
    ops = load_kernels()
    k = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="packed KV layout is bfloat16, int8 or fp8 only"):
        ops.reshape_and_cache(k, k, torch.zeros(2, 4, 16, 1, 64, dtype=torch.float16), torch.tensor([0]), True)
    if not ops.has_packed_int8_layout():
        for dtype in CODES:
            cache = torch.zeros(2, 4, 16, 1, 66, dtype=torch.uint8).view(dtype)
            with pytest.raises(RuntimeError, match="no packed int8 or fp8 KV layout"):
                ops.reshape_and_cache(k, k, cache, torch.tensor([0]), True)
    cache = torch.zeros(2, 4, 16, 1, 66, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="block size that is a multiple of 16"):
        ops.reshape_and_cache(k, k, torch.zeros(2, 4, 8, 1, 66, dtype=torch.int8), torch.tensor([0]), True)
    with pytest.raises(RuntimeError, match="head_dim \\+ 2"):
        ops.reshape_and_cache(torch.zeros(1, 1, 66), torch.zeros(1, 1, 66), cache, torch.tensor([0]), False)


@pytest.mark.parametrize("dtype", CODES)
def test_block_copies_and_swaps_carry_the_scales(dtype):
    from kvpage.model.config import ModelConfig
    from kvpage.worker.kv_cache import KVCache

    cfg = ModelConfig(name="t", architecture="llama", num_layers=2, num_attention_heads=2, num_kv_heads=1,
                      head_dim=32)
    kv = KVCache(cfg, 8, 4, dtype, num_host_blocks=4)
    assert kv.tensors[0].shape == (2, 8, 4, 1, 34)
    for t in kv.tensors:
        write_rows(torch.randn(32, 1, 32), torch.randn(32, 1, 32), t, torch.arange(32))
    before = [dequantize_rows(t[:, 2]) for t in kv.tensors]
    kv.copy_blocks([(2, 5)])
    kv.swap_out([(2, 1)])
    kv.swap_in([(1, 7)])
    for t, b in zip(kv.tensors, before, strict=True):  # codes and scales moved together
        assert torch.equal(dequantize_rows(t[:, 5]), b) and torch.equal(dequantize_rows(t[:, 7]), b)

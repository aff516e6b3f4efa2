"""Sliding-window attention in the compiled kernels against the reference backend: every row-layout loop
(float32, bf16 and float16 caches; bf16 and float32 queries) and the packed bf16 loops (AVX-512 and AMX),
head sizes 64, 128 and 256, decodes, chunks and whole prompts that cross the window's edge, block sizes that
cut it mid-block and window edges inside a 16-key group, partitions. Blocks wholly before
every query's window hold NaN and sit behind placeholder table entries: a kernel that read one would say so."""

from __future__ import annotations

import random

import pytest
import torch

from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.ops import load_kernels, pack_kv_rows
from tests.helpers.kernels import have_cxx, step_metadata

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


def window_case(rng: random.Random, block_size: int, heads: int, kv_heads: int, dim: int, window: int,
                kv_dtype: torch.dtype, q_dtype: torch.dtype):
    num_seqs = rng.randint(1, 4)
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        ctx = rng.randint(1, 3 * window + 40)
        q_len = rng.choice([1, 1, min(ctx, rng.randint(2, 40)), ctx])
        q_lens.append(q_len)
        seq_lens.append(ctx)
    blocks_per_seq = [-(-c // block_size) for c in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim).to(kv_dtype)
    tables = torch.zeros((num_seqs, max(blocks_per_seq)), dtype=torch.long)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    at = 0
    for i, n in enumerate(blocks_per_seq):
        first_query = seq_lens[i] - q_lens[i]
        first_needed = max(0, first_query - window + 1) // block_size
        for b in range(n):
            if b < first_needed:  # wholly before every query's window: a placeholder, its block poisoned
                poisoned = ids[at]
                cache[:, poisoned] = float("nan")
                tables[i, b] = 0 if rng.random() < 0.5 else poisoned
            else:
                tables[i, b] = ids[at]
            at += 1
    total = sum(q_lens)
    q = torch.randn(total, heads, dim).to(q_dtype)
    k = torch.randn(total, kv_heads, dim).to(q_dtype)
    v = torch.randn(total, kv_heads, dim).to(q_dtype)
    return q, k, v, cache, step_metadata(tables, q_lens, seq_lens, block_size, window)


def reference(q, k, v, cache, meta, scale):
    clean = cache.clone().nan_to_num(0.0)  # the reference gathers placeholders too (masked, never weighed)
    return ReferenceAttention().forward(q.float(), k.float(), v.float(), clean, meta, scale), clean


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize(("kv_dtype", "q_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_sliding_window_matches_the_reference(dim, block_size, kv_dtype, q_dtype):
    ops = load_kernels()
    rng = random.Random(dim * 7 + block_size)
    for window in (1, 7, 33, 64):
        q, k, v, cache, meta = window_case(rng, block_size, 8, 2, dim, window, kv_dtype, q_dtype)
        ref, _ = reference(q, k, v, cache, meta, dim**-0.5)
        ker_cache = cache.clone()
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        for part in (512, 16):
            plan = ops.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, 8, cache.shape[1],
                                      block_size, part, True, window)
            out = ops.paged_attention_planned(q, ker_cache, plan, dim**-0.5, False, True)
            assert not out.float().isnan().any(), "a block outside the window was read"
            tol = 1e-4 if kv_dtype == q_dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_window_plans_skip_whole_blocks_and_partitions():
    """A decode at position 5000 with a window of 512 makes tasks for the window's keys only."""
    ops = load_kernels()
    tables = torch.arange(400, dtype=torch.long)[None, :]
    qsl, lens = torch.tensor([0, 1]), torch.tensor([5001])
    full = ops.plan_attention(tables, qsl, lens, 4, 400, 16, 512, False, 0)
    windowed = ops.plan_attention(tables, qsl, lens, 4, 400, 16, 512, False, 512)
    assert full.num_tasks == 10 and windowed.num_tasks == 2 and windowed.window == 512
    bad = tables.clone()
    bad[0, :280] = 10_000  # outside the cache, but before the window: never read, so accepted
    ops.plan_attention(bad, qsl, lens, 4, 400, 16, 512, False, 512)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.plan_attention(bad, qsl, lens, 4, 400, 16, 512, False, 0)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 48])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 1)])
def test_packed_sliding_window_matches_the_reference(dim, block_size, heads, kv_heads):
    """The packed bf16 layout under a window: decode on the AVX-512 loop and on AMX tiles (all-rows kernel at
    head size 64, per-head kernel otherwise), chunks and prompts on the AVX-512 loop; a window's edge falls
    anywhere in a 16-key group, so each loop starts at the group and masks the keys before the edge."""
    ops = load_kernels()
    if not ops.has_packed_layout():
        pytest.skip("this build has no packed layout (no AVX512-BF16)")
    rng = random.Random(dim * 11 + block_size + heads)
    for window in (1, 7, 33, 64):
        q, k, v, cache, meta = window_case(rng, block_size, heads, kv_heads, dim, window, torch.bfloat16,
                                           torch.bfloat16)
        ref, _ = reference(q, k, v, cache, meta, dim**-0.5)
        packed = pack_kv_rows(cache)  # NaN blocks stay NaN: packing only moves elements within a block
        ops.reshape_and_cache(k, v, packed, meta.slot_mapping, True)
        for part in (512, 16):
            plan = ops.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, heads,
                                      cache.shape[1], block_size, part, True, window)
            for amx in (False, True):
                out = ops.paged_attention_planned(q, packed, plan, dim**-0.5, True, amx, False)
                on_tiles = amx and ops.amx_decode_available()
                assert ops.last_decode_kernel() == ("avx512-packed" if not on_tiles
                                                    else "amx-pairs" if dim == 64 else "amx-packed")
                assert not out.float().isnan().any(), "a block outside the window was read"
                torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("window", [7, 33, 100])
def test_backend_sends_long_window_chunks_to_the_amx_prompt_kernel(dim, window):
    """Under a window the CPU backend sends chunks of >= 16 rows (after cached keys or fresh) to the AMX prompt
    kernel with the window, decodes and short chunks to the paged kernel: the step equals the reference, and
    none of the poisoned blocks before each sequence's first window is read."""
    from kvpage.attention.backends.cpu import CpuPagedAttention
    from kvpage.envs import KernelConfig
    from kvpage.ops import kernels

    backend = CpuPagedAttention(kernels(KernelConfig(batch_invariant="0")))
    if not (backend.prefill_cached and backend.packed_ok):
        pytest.skip("no AMX prompt kernel reading the packed cache on this CPU")
    heads, kv_heads, bs = 4, 1, 16
    # runner order: decodes and short chunks, long chunks after cached keys, whole fresh prompts
    q_lens, seq_lens = [1, 1, 5, 40, 20, 70, 200], [50, 700, 90, 140, 620, 70, 200]
    blocks = [-(-c // bs) for c in seq_lens]
    num_blocks = sum(blocks) + 1
    g = torch.Generator().manual_seed(dim + window)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=g).bfloat16()
    tables = torch.zeros(len(q_lens), max(blocks), dtype=torch.long)
    at = 1
    for i, n in enumerate(blocks):
        first_needed = max(0, seq_lens[i] - q_lens[i] - window + 1) // bs
        for b in range(n):
            if b < first_needed:  # a placeholder naming a poisoned block
                cache[:, at] = float("nan")
            tables[i, b] = at
            at += 1
    meta = step_metadata(tables, q_lens, seq_lens, bs, window)
    q = torch.randn(sum(q_lens), heads, dim, generator=g).bfloat16()
    k = torch.randn(sum(q_lens), kv_heads, dim, generator=g).bfloat16()
    v = torch.randn(sum(q_lens), kv_heads, dim, generator=g).bfloat16()
    ref, _ = reference(q, k, v, cache, meta, dim**-0.5)
    packed = pack_kv_rows(cache)
    step = backend.metadata_builder(packed, torch.bfloat16, heads, window).build(meta)
    assert step.prompts_read_cache and step.window == window
    assert step.paged_seqs == 3 and step.cached_prefills == ((7, 40), (47, 20)) and len(step.fresh_prefills) == 2
    out = backend.forward(q, k, v, packed, step, dim**-0.5)
    assert not out.float().isnan().any(), "a block before the window was read"
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)

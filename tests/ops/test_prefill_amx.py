"""Causal attention of prompts with AMX tiles (csrc/attention/prefill_amx.cpp): matches a float32 reference
for ragged prompt lengths (partial 16-row and 32-key blocks), GQA ratios, head sizes 64 / 128 / 256, sliding
windows (fresh prompts over their own K/V, and chunks reading none of the blocks before their first window) and
prompts packed at any offset of a step's
batch read through strided views of one qkv tensor; leaves rows outside the prompts alone; refuses what it
cannot take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.kernels import amx_ops


def _ops():
    return amx_ops("prefill_amx_available")


def _batch(heads, kv_heads, lengths, seed, gap=3, dim=64):
    g = torch.Generator().manual_seed(seed)
    starts, pos = [], gap
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    qkv = (torch.randn(pos, (heads + 2 * kv_heads) * dim, generator=g) * 2).bfloat16()
    q = qkv[:, : heads * dim].view(pos, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(pos, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(pos, kv_heads, dim)
    return q, k, v, starts


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 64), (8, 2, 64), (6, 1, 64), (4, 1, 256),
                                                (4, 2, 128)])
def test_matches_float32_causal_attention(heads, kv_heads, dim):
    ops = _ops()
    lengths = [1, 15, 16, 17, 31, 33, 100, 257]
    q, k, v, starts = _batch(heads, kv_heads, lengths, seed=heads * 10 + kv_heads, dim=dim)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    ops.prefill_attention(q, k, v, out, starts, lengths, 0.125)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for s, n in zip(starts, lengths, strict=True):
        sl = slice(s, s + n)
        ref = F.scaled_dot_product_attention(q[sl].transpose(0, 1)[None].float(), k[sl].transpose(0, 1)[None].float(),
                                             v[sl].transpose(0, 1)[None].float(), is_causal=True, scale=0.125,
                                             enable_gqa=True)[0].transpose(0, 1)
        # bf16 weights and output: a few bf16 ulps of the output's magnitude
        assert (out[sl].float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (s, n)
        covered[sl] = True
    assert (out[~covered] == 7.0).all()  # rows between prompts untouched


def test_one_token_prompt_is_its_own_value():
    ops = _ops()
    q, k, v, starts = _batch(4, 2, [1], seed=3)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    ops.prefill_attention(q, k, v, out, starts, [1], 0.125)
    s = starts[0]
    assert torch.equal(out[s], v[s].repeat_interleave(2, 0))


def test_refuses_bad_input():
    ops = _ops()
    q, k, v, starts = _batch(4, 2, [20], seed=1)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the batch"):
        ops.prefill_attention(q, k, v, out, [q.shape[0] - 5], [20], 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        ops.prefill_attention(q[..., :32], k[..., :32], v[..., :32], out[..., :32], starts, [20], 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.prefill_attention(q[:, :3], k, v, out[:, :3], starts, [20], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.prefill_attention(q.float(), k, v, out, starts, [20], 0.125)


def _paged_case(heads, kv_heads, chunks, seed, block_size=16, block_major=True, dim=64, window=0):
    """A packed bf16 cache holding, per sequence, `cached + n` keys in randomly placed blocks, every other slot
    NaN; queries for its last n positions at scattered rows of one step's batch. Block-major storage as the
    engine allocates it, or a plain contiguous tensor. With a window, the table entries of blocks wholly before
    the first query's window name a spare all-NaN block instead (a freed block may hold anything)."""
    from kvpage.ops import pack_kv_rows
    from kvpage.worker.kv_cache import as_block_major

    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) + 1 for c, n in chunks]  # one spare block per sequence (never read)
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    rows = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=torch.bfloat16)
    tables = torch.zeros(len(chunks), max(need), dtype=torch.long)
    keys, values, used = [], [], 0
    for i, (c, n) in enumerate(chunks):
        tables[i, : need[i]] = perm[used : used + need[i]]
        used += need[i]
        k = (torch.randn(c + n, kv_heads, dim, generator=g) * 2).bfloat16()
        v = (torch.randn(c + n, kv_heads, dim, generator=g) * 2).bfloat16()
        for pos in range(c + n):
            blk, off = tables[i, pos // block_size], pos % block_size
            rows[0, blk, off], rows[1, blk, off] = k[pos], v[pos]
        if window:
            edge = max(0, c - window + 1)
            tables[i, : edge // block_size] = perm[-1]  # never written: all NaN
        keys.append(k)
        values.append(v)
    starts, pos = [], 2
    for _, n in chunks:
        starts.append(pos)
        pos += n + 2
    q = (torch.randn(pos, heads, dim, generator=g) * 2).bfloat16()
    packed = pack_kv_rows(rows)
    return q, as_block_major(packed) if block_major else packed, tables, starts, keys, values


def _check_chunk(out, q, keys, values, c, n, window):
    """A chunk of n queries after c cached keys against float32 attention: query r sees keys 0 .. c + r (with a
    window, only c + r - window + 1 .. c + r); finite, within a few bf16 ulps of the output's magnitude."""
    key_pos, query_pos = torch.arange(c + n)[None, :], (c + torch.arange(n))[:, None]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), keys.transpose(0, 1)[None].float(),
                                         values.transpose(0, 1)[None].float(), attn_mask=mask, scale=0.125,
                                         enable_gqa=True)[0].transpose(0, 1)
    assert torch.isfinite(out.float()).all(), (c, n)
    assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (c, n)


@pytest.mark.parametrize("heads,kv_heads,block_size,scratch,block_major",
                         [(9, 3, 16, 64 << 20, True), (4, 4, 32, 64 << 20, False), (8, 2, 16, 1, True),
                          (6, 1, 64, 100_000, False)])
def test_paged_chunks_after_cached_keys_match_float32(heads, kv_heads, block_size, scratch, block_major):
    """Chunks after cached prefixes of any alignment (and c = 0, a fresh prompt read from the cache) against
    float32 attention of the chunk's queries over all its keys; the cache's never-written slots are NaN. A
    small scratch bound splits the prompts into groups (1 byte: one prompt per group)."""
    ops = _ops()
    chunks = [(0, 40), (5, 1), (16, 16), (37, 70), (249, 130), (3, 257), (100, 15)]
    q, cache, tables, starts, keys, values = _paged_case(heads, kv_heads, chunks, seed=heads + block_size,
                                                         block_size=block_size, block_major=block_major)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    ops.prefill_attention_paged(q, cache, tables, out, starts, [n for _, n in chunks], [c + n for c, n in chunks],
                                list(range(len(chunks))), 0.125, scratch)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for i, (c, n) in enumerate(chunks):
        sl = slice(starts[i], starts[i] + n)
        _check_chunk(out[sl], q[sl], keys[i], values[i], c, n, window=0)
        covered[sl] = True
    assert (out[~covered] == 7.0).all()


@pytest.mark.parametrize("dim,window,block_size", [(256, 40, 16), (256, 100, 32), (64, 17, 16), (128, 512, 16)])
def test_paged_window_matches_float32(dim, window, block_size):
    """A sliding window (query r of a chunk after c cached keys sees keys c + r - window + 1 .. c + r) against
    float32 attention under the same mask; the blocks before each chunk's first window are NaN placeholders, so
    reading (or weighting) any of them would show."""
    ops = _ops()
    chunks = [(0, 40), (5, 1), (16, 16), (37, 70), (249, 130), (3, 257), (600, 15), (100, 33)]
    q, cache, tables, starts, keys, values = _paged_case(4, 1, chunks, seed=dim + window, block_size=block_size,
                                                         dim=dim, window=window)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    ops.prefill_attention_paged(q, cache, tables, out, starts, [n for _, n in chunks], [c + n for c, n in chunks],
                                list(range(len(chunks))), 0.125, window=window)
    for i, (c, n) in enumerate(chunks):
        sl = slice(starts[i], starts[i] + n)
        _check_chunk(out[sl], q[sl], keys[i], values[i], c, n, window)


def test_paged_fresh_prompt_equals_rows_kernel():
    """c = 0 read from the cache is the same computation as the rows kernel: bit-equal outputs."""
    ops = _ops()
    chunks = [(0, 33), (0, 200)]
    q, cache, tables, starts, keys, values = _paged_case(9, 3, chunks, seed=5)
    a = torch.zeros(q.shape, dtype=torch.bfloat16)
    ops.prefill_attention_paged(q, cache, tables, a, starts, [33, 200], [33, 200], [0, 1], 0.125)
    k = torch.zeros(q.shape[0], 3, 64, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for i, (_, n) in enumerate(chunks):
        k[starts[i] : starts[i] + n], v[starts[i] : starts[i] + n] = keys[i], values[i]
    b = torch.zeros(q.shape, dtype=torch.bfloat16)
    ops.prefill_attention(q, k, v, b, starts, [33, 200], 0.125)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dim,window", [(256, 40), (256, 512), (64, 17), (128, 100)])
def test_fresh_window_matches_float32_and_the_paged_kernel(dim, window):
    """Whole fresh prompts under a sliding window over their own K/V (quantized pages' sliding-window layers):
    float32 attention under the window's mask, and the bits of the same prompts read from a packed cache."""
    ops = _ops()
    lengths = [1, 17, 40, 41, 130, 600]
    q, k, v, starts = _batch(4, 1, lengths, seed=dim + window, dim=dim)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    ops.prefill_attention(q, k, v, out, starts, lengths, 0.125, window=window)
    for s, n in zip(starts, lengths, strict=True):
        sl = slice(s, s + n)
        _check_chunk(out[sl], q[sl], k[sl], v[sl], 0, n, window)
    chunks = [(0, 33), (0, 200)]
    q, cache, tables, starts, keys, values = _paged_case(4, 1, chunks, seed=9, dim=dim)
    a = torch.zeros(q.shape, dtype=torch.bfloat16)
    ops.prefill_attention_paged(q, cache, tables, a, starts, [33, 200], [33, 200], [0, 1], 0.125, window=window)
    k = torch.zeros(q.shape[0], 1, dim, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for i, (_, n) in enumerate(chunks):
        k[starts[i] : starts[i] + n], v[starts[i] : starts[i] + n] = keys[i], values[i]
    b = torch.zeros(q.shape, dtype=torch.bfloat16)
    ops.prefill_attention(q, k, v, b, starts, [33, 200], 0.125, window=window)
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="window must be"):
        ops.prefill_attention(q, k, v, b, starts, [33, 200], 0.125, window=-1)


def test_paged_refuses_bad_input():
    ops = _ops()
    q, cache, tables, starts, _, _ = _paged_case(4, 2, [(10, 20)], seed=2)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fewer keys"):
        ops.prefill_attention_paged(q, cache, tables, out, starts, [20], [19], [0], 0.125)
    with pytest.raises(RuntimeError, match="no block table row"):
        ops.prefill_attention_paged(q, cache, tables, out, starts, [20], [30], [1], 0.125)
    with pytest.raises(RuntimeError, match="more blocks"):
        ops.prefill_attention_paged(q, cache, tables, out, starts, [20], [30 + 16 * tables.shape[1]], [0], 0.125)
    bad = tables.clone()
    bad[0, 0] = cache.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.prefill_attention_paged(q, cache, bad, out, starts, [20], [30], [0], 0.125)
    with pytest.raises(RuntimeError, match="outside the batch"):
        ops.prefill_attention_paged(q, cache, tables, out, [q.shape[0] - 5], [20], [30], [0], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.prefill_attention_paged(q, cache.float(), tables, out, starts, [20], [30], [0], 0.125)
    with pytest.raises(RuntimeError, match="window must be"):
        ops.prefill_attention_paged(q, cache, tables, out, starts, [20], [30], [0], 0.125, window=-1)
    with pytest.raises(RuntimeError, match="head size"):
        ops.prefill_attention_paged(q[..., :32].contiguous(), cache, tables, out[..., :32].contiguous(), starts, [20],
                                    [30], [0], 0.125)

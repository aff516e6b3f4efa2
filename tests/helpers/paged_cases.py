"""Random paged-attention cases for the kernel tests: ragged contexts scattered over a cache, in both storage
orders, and a dense float32 reference to hold decode results against."""

from __future__ import annotations

import random

import torch

from kvpage.ops import PARTITION_SIZE
from kvpage.worker.kv_cache import as_block_major
from tests.helpers.kernels import scatter_tables, step_metadata


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

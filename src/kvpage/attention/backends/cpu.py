"""The compiled CPU paged-attention backend: the kernels of kvpage.ops behind the backend seam.

Decode rows go to the paged kernel; whole fresh prompts and prompt chunks after cached keys go to the AMX
prompt kernels where the CPU has them (torch's SDPA otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import AttentionMetadata
from kvpage.ops import Kernels


class CpuPagedAttention:
    name = "cpu"

    def __init__(self, ops: Kernels) -> None:
        self.ops = ops
        # The packed bf16 layout unless the configuration keeps rows (kv_layout, for side-by-side measurements).
        self.packed_ok = ops.packed_layout
        # Fresh prompts with AMX tile products where the CPU has them (1.6-2.5x torch's SDPA at 64-1000
        # tokens); amx_prefill=False keeps SDPA (side-by-side measurements).
        self.amx_prefill = ops.amx_prefill_ok
        # Prompt chunks after cached keys on that kernel too, reading the packed cache; prefill_cached=False
        # sends them to the paged kernel (side-by-side measurements, benchmarks/long_prompt.py).
        self.prefill_cached = self.amx_prefill and ops.config.prefill_cached

    def packed_layout(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether a cache written and read with activations of `dtype` holds the packed layout: decided by the
        tensors alone, so every write and every read of one cache agree."""
        _, _, block_size, _, head_dim = kv_cache.shape
        return (self.packed_ok and kv_cache.dtype == torch.bfloat16 and dtype == torch.bfloat16
                and block_size % 16 == 0 and head_dim in (64, 128))

    def prompts_read_cache(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether long prompt chunks over this cache (fresh or after cached keys) go to the AMX prompt kernel
        that reads their keys from the packed cache (prefill_attention_paged)."""
        return self.prefill_cached and self.packed_layout(kv_cache, dtype) and kv_cache.shape[4] == 64

    def prefill_min(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> int:
        """Query rows from which the runner groups a prompt chunk for the prompt kernel: 16 where chunks read
        the packed cache with AMX (1.7-3x the paged kernel at 16 rows after 500-2000 cached keys, at par near
        8), else 64 (the paged kernel; SDPA, one call per prompt, for longer fresh prompts)."""
        return 16 if self.prompts_read_cache(kv_cache, dtype) else 64

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        packed = self.packed_layout(kv_cache, query.dtype)
        self.ops.reshape_and_cache(key, value, kv_cache, meta.slot_mapping, packed)
        if not meta.fresh_prefills and not meta.cached_prefills:
            return self.ops.paged_attention(query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                            scale, packed)
        out = torch.empty(query.shape, dtype=query.dtype)
        ns, nr = meta.paged_seqs, meta.paged_rows
        if ns > 0:
            out[:nr] = self.ops.paged_attention(query[:nr], kv_cache, meta.block_tables[:ns],
                                                meta.query_start_loc[: ns + 1], meta.seq_lens[:ns], scale, packed)
        prompts = meta.cached_prefills + meta.fresh_prefills
        if self.prompts_read_cache(kv_cache, query.dtype):
            # every long prompt chunk, cached prefix or not, in one call reading its keys from the cache
            # (written just above): ops/csrc/attention/prefill_amx.cpp
            seqs = range(ns, ns + len(prompts))
            self.ops.prefill_attention_paged(query, kv_cache, meta.block_tables, out, [s for s, _ in prompts],
                                             [n for _, n in prompts], [meta.seq_lens_list[i] for i in seqs],
                                             list(seqs), scale)
            return out
        if meta.cached_prefills:  # chunks after cached keys: the paged kernel over their slice of the batch
            nc = len(meta.cached_prefills)
            r0 = meta.cached_prefills[0][0]
            r1 = meta.cached_prefills[-1][0] + meta.cached_prefills[-1][1]
            out[r0:r1] = self.ops.paged_attention(query[r0:r1], kv_cache, meta.block_tables[ns : ns + nc],
                                                  meta.query_start_loc[ns : ns + nc + 1] - r0,
                                                  meta.seq_lens[ns : ns + nc], scale, packed)
        if not meta.fresh_prefills:
            return out
        if self.amx_prefill and query.dtype == key.dtype == value.dtype == torch.bfloat16 and query.shape[2] == 64:
            # whole prompts, nothing cached: one call for all of them (ops/csrc/attention/prefill_amx.cpp)
            starts = [start for start, _ in meta.fresh_prefills]
            self.ops.prefill_attention(query, key, value, out, starts, [n for _, n in meta.fresh_prefills], scale)
            return out
        gqa = query.shape[1] != key.shape[1]
        for start, n in meta.fresh_prefills:  # whole prompt, nothing cached: dense causal attention
            q = query[start : start + n].transpose(0, 1)[None]
            k = key[start : start + n].transpose(0, 1)[None].to(q.dtype)
            v = value[start : start + n].transpose(0, 1)[None].to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            out[start : start + n] = o[0].transpose(0, 1)
        return out

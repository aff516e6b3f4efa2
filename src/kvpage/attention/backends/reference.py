"""Reference paged attention in plain torch: obviously correct, one sequence at a time (a sliding window
masks keys before each query's window; the blocks it gathers there may be placeholders, masked unread).

Every case goes through the same path: a whole prompt, a prompt chunk, a prompt after a prefix-cache hit
and a decode token are all "query_len new tokens at the end of a context of seq_len tokens".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention.backends.base import CommonMetadata, write_kv
from kvpage.attention.kv_quant import dequantize_rows, is_quantized, read_keys
from kvpage.attention.metadata import AttentionMetadata


class ReferenceAttention:
    name = "reference"

    def metadata_builder(self, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int,
                         window: int | None = None, allow_packed: bool = True) -> CommonMetadata:
        return CommonMetadata()

    def packs_windows(self, kv_cache: torch.Tensor) -> bool:
        return False  # one layout only

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.slot_mapping)
        bs = meta.block_size
        out = torch.empty_like(query)
        heads, kv_heads = query.shape[1], kv_cache.shape[3]
        gqa = heads != kv_heads
        quantized = is_quantized(kv_cache.dtype)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
            n_blocks = -(-ctx_len // bs)
            blocks = meta.block_tables[i, :n_blocks]
            # Gather this sequence's history through its block table: [ctx_len, kv_heads, dim].
            if quantized:  # dequantized pages: codes x their row's scale, in float32
                k = read_keys(kv_cache.view(torch.uint8)[0, blocks].view(kv_cache.dtype))
                v = dequantize_rows(kv_cache.view(torch.uint8)[1, blocks].view(kv_cache.dtype))
                k = k.reshape(n_blocks * bs, kv_heads, -1)[:ctx_len]
                v = v.reshape(n_blocks * bs, kv_heads, -1)[:ctx_len]
            else:
                k = kv_cache[0, blocks].reshape(n_blocks * bs, kv_heads, -1)[:ctx_len]
                v = kv_cache[1, blocks].reshape(n_blocks * bs, kv_heads, -1)[:ctx_len]
            q = query[start : start + q_len]
            qt = q.transpose(0, 1)[None]
            kt = k.transpose(0, 1)[None].to(q.dtype)
            vt = v.transpose(0, 1)[None].to(q.dtype)
            if meta.window is not None:  # query j at position p sees keys p - window < key <= p
                qpos = torch.arange(ctx_len - q_len, ctx_len)
                kpos = torch.arange(ctx_len)[None, :]
                mask = (kpos <= qpos[:, None]) & (kpos > qpos[:, None] - meta.window)
                o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
            elif q_len == ctx_len:  # nothing cached before: plain causal
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=q_len > 1, scale=scale, enable_gqa=gqa)
            elif q_len == 1:  # decode: the one new token sees everything
                o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa)
            else:  # new tokens after cached ones: query j sits at position ctx_len - q_len + j
                qpos = torch.arange(ctx_len - q_len, ctx_len)
                mask = torch.arange(ctx_len)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out

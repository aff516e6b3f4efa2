"""Reference paged attention in plain torch: obviously correct, one sequence at a time (a sliding window
masks keys before each query's window; the blocks it gathers there may be placeholders, masked unread).

Every case goes through the same path: a whole prompt, a prompt chunk, a prompt after a prefix-cache hit
and a decode token are all "query_len new tokens at the end of a context of seq_len tokens".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention import kv_channel
from kvpage.attention.backends.base import CommonMetadata, write_kv
from kvpage.attention.kv_quant import dequantize_rows, is_quantized, read_keys
from kvpage.attention.kv_transform import affine_rows
from kvpage.attention.metadata import AttentionMetadata


class ReferenceAttention:
    name = "reference"
    transform_rows = staticmethod(affine_rows)

    def metadata_builder(self, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int,
                         window: int | None = None) -> CommonMetadata:
        return CommonMetadata()

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float,
                key_feedback: torch.Tensor | None = None) -> torch.Tensor:
        bs = meta.block_size
        channel = kv_channel.is_channel_pages(kv_cache)
        if channel:
            if key_feedback is not None:
                raise ValueError("key rounding feedback is for int8 rows, not keys per channel")
            if meta.residual_slot_mapping is None or meta.residual_block_tables is None:
                raise ValueError("int8 pages with keys per channel need the residual-key group's slots and tables")
            kv_channel.write_pages(key, value, kv_cache, meta.slot_mapping, meta.residual_slot_mapping, bs)
        else:
            write_kv(key, value, kv_cache, meta.slot_mapping, key_feedback)
        out = torch.empty_like(query)
        heads, kv_heads, dim = query.shape[1], key.shape[1], key.shape[2]
        gqa = heads != kv_heads
        quantized = is_quantized(kv_cache.dtype)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
            n_blocks = -(-ctx_len // bs)
            blocks = meta.block_tables[i, :n_blocks]
            # Gather this sequence's history through its block table: [ctx_len, kv_heads, dim].
            if channel:  # the filling block's keys from its residual block; placeholder blocks (before a window,
                # masked below) may hold any bytes: zeroed, so that no NaN reaches the output through a 0 weight
                filling = int(meta.residual_block_tables[i, ctx_len // bs]) if ctx_len % bs else 0
                k = kv_channel.read_keys(kv_cache, blocks, filling, ctx_len, bs, kv_heads, dim).nan_to_num(0, 0, 0)
                v = kv_channel.read_values(kv_cache, blocks, ctx_len, bs, kv_heads, dim).nan_to_num(0, 0, 0)
            elif quantized:  # dequantized pages: codes x their row's scale, in float32
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

"""Scoring a token stream through the paged cache: the logits at every position, the stream fed in chunks
that each attend through the cache (no whole-prompt shortcut), so a cache's dtype shows in every position.
Used to measure what a KV cache dtype costs in accuracy (teacher-forced agreement, perplexity)."""

from __future__ import annotations

import torch

from kvpage.kv.block import DEFAULT_BLOCK_SIZE
from kvpage.kv.hybrid import HybridKVManager
from kvpage.kv.paged import KVCacheManager
from kvpage.kv.sequence import KVSequence
from kvpage.worker.kv_cache import KVCache, model_layout
from kvpage.worker.model_runner import ModelRunner, ScheduledSeq


def chunked_logits(lm, ids: list[int], kv_dtype: torch.dtype, chunk: int = 32,
                   block_size: int = DEFAULT_BLOCK_SIZE, channel_keys: bool = False) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of loaded model ``lm`` over a fresh cache of ``kv_dtype``. Chunks
    below the prompt kernels' threshold go to the paged kernel, which reads each chunk's keys back from the
    pages it has just written. ``channel_keys``: int8 pages with keys per channel (and their residual keys)."""
    return torch.cat(_feed(lm, ids, kv_dtype, chunk, block_size, True, channel_keys))


def chunked_hidden(lm, ids: list[int], kv_dtype: torch.dtype, chunk: int = 32,
                   block_size: int = DEFAULT_BLOCK_SIZE, channel_keys: bool = False) -> torch.Tensor:
    """The same pass, the final hidden states ``[len(ids), hidden]`` instead of logits (every tensor-parallel
    rank can run it: no gather to rank 0)."""
    return torch.cat(_feed(lm, ids, kv_dtype, chunk, block_size, False, channel_keys))


def _feed(lm, ids: list[int], kv_dtype: torch.dtype, chunk: int, block_size: int, logits: bool,
          channel_keys: bool) -> list:
    layout = model_layout(lm.config, channel_keys)
    num_blocks = (-(-len(ids) // block_size) + 1) * len(layout.groups)
    cache = KVCache(lm.config, num_blocks, block_size, kv_dtype, layout=layout, channel_keys=channel_keys)
    hybrid = layout.hybrid
    n = cache.num_blocks
    m = HybridKVManager(cache.layout, n, block_size, watermark=0.0) if hybrid else KVCacheManager(
        n, block_size, watermark=0.0)
    runner = ModelRunner(lm.model, cache)
    rows = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        if m.allocate_slots(KVSequence("s", ids[: start + len(part)]), len(part)) is None:
            raise RuntimeError("the scoring cache is too small")
        tables = m.block_tables("s")
        seq = ScheduledSeq("s", part, start, tables[0], all_logits=True, block_tables=tables if hybrid else None)
        rows.append(runner.execute([seq])["s"].float() if logits else runner.forward_only([seq])[-1].float())
    return rows

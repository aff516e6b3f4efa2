"""The compiled CPU paged-attention backend: the kernels of kvpage.ops behind the backend seam.

Decode rows go to the paged kernel; whole fresh prompts and prompt chunks after cached keys go to the AMX
prompt kernels where the CPU has them, else to the paged kernel (fresh prompts over quantized pages: over a
scratch cache of their own K/V in the activations' dtype) or torch's SDPA. ``CpuMetadataBuilder``
makes those choices and plans the paged kernel's tasks once per step; ``forward`` only follows them, layer
after layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from kvpage.attention.kv_channel import is_channel_pages
from kvpage.attention.kv_quant import head_dim_of, is_quantized
from kvpage.attention.metadata import AttentionMetadata
from kvpage.ops import Kernels

# Without a prompt kernel that reads the cache, chunks of at least this many rows are grouped as prompt work
# (SDPA for whole fresh prompts from here on; the paged kernel below it).
PREFILL_KERNEL_MIN = 64
SCRATCH_BLOCK = 16  # tokens per block of the fresh prompts' scratch cache over quantized pages


@dataclass
class CpuAttentionMetadata:
    """The step as the CPU kernels take it. The runner ordered the batch: the first ``paged_seqs`` sequences
    (rows [0, paged_rows)) are decodes and short chunks for the paged kernel; then ``cached_prefills``, prompt
    chunks after cached keys (each (start row, length)); then ``fresh_prefills``, whole prompts with nothing
    cached before them."""

    common: AttentionMetadata
    packed: bool  # the caches hold the packed layout, bf16 or int8 (every write and read of this step agree)
    prompts_read_cache: bool  # long prompt chunks go to the AMX prompt kernel that reads keys from the cache
    paged_seqs: int
    paged_rows: int
    cached_prefills: tuple[tuple[int, int], ...]
    fresh_prefills: tuple[tuple[int, int], ...]
    plan: Any  # ops AttentionPlan of the paged group (None when it is empty)
    cached_plan: Any = None  # the chunks after cached keys on the paged kernel (when no prompt kernel takes them)
    # quantized pages: the whole fresh prompts' plan over a scratch bf16 cache of their own K/V, that cache (one
    # per step, every layer overwrites it) and where each prompt's rows start in it (fresh_on_scratch)
    fresh_plan: Any = None
    fresh_scratch: torch.Tensor | None = None
    fresh_first_rows: tuple[int, ...] = ()
    # int8 pages with keys per channel: every row on their paged kernel (paged_attention_channel)
    channel: bool = False
    window: int | None = None  # the layers' sliding window (the AMX prompt kernel reads it; the plans hold it)

    @property
    def decode_only(self) -> bool:
        """Every sequence is paged-kernel work on row pages (what the compiled decode layer stack runs)."""
        return not self.cached_prefills and not self.fresh_prefills and not self.channel

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common.slot_mapping


class CpuMetadataBuilder:
    """Splits and plans one step for caches of one shape and dtype (every layer of a KV group)."""

    def __init__(self, backend: CpuPagedAttention, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int,
                 window: int | None = None) -> None:
        self.ops = backend.ops
        self.num_heads = num_heads
        self.window = window
        # int8 pages with keys per channel ([blocks, page_bytes], attention/kv_channel.py): one paged kernel for
        # every row, decode and prompt alike, planned at each step's block size
        self.channel = is_channel_pages(kv_cache)
        if self.channel:
            self.num_blocks, self.packed, self.prompts_read_cache = kv_cache.shape[0], False, False
            self.prefill_min, self.fresh_on_scratch = None, False
            return
        self.num_blocks, self.block_size, self.kv_heads = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
        self.head_dim = head_dim_of(kv_cache)
        self.packed = backend.packed_layout(kv_cache, dtype)
        self.prompts_read_cache = self.packed and backend.prompts_read_cache(kv_cache, dtype)
        # 16 where chunks read the packed cache with AMX (1.7-3x the paged kernel at 16 rows after 500-2000
        # cached keys, at par near 8; with a sliding window its tasks start at each row block's window edge),
        # else 64 (the paged kernel; SDPA for longer fresh prompts). Without that kernel a sliding window sends
        # everything to the paged kernel, whose tiles skip what lies before each window, unless fresh prompts
        # can take the AMX prompt kernel over their own K/V (quantized pages where AMX is granted: Gemma 3's
        # int8 engine, offline sharegpt, AMX Xeon, 2026-12-02: see fresh_window below); so do bf16 caches
        # without the AMX prompt kernel (benchmarks/prefill.py on a Zen 5 EPYC: the paged kernel 1.7-2.8x SDPA at
        # 64-2048 tokens over packed blocks, 1.9-3.2x over rows of head size 256).
        fresh_window = (window is not None and backend.amx_prefill and is_quantized(kv_cache.dtype)
                        and dtype == torch.bfloat16 and self.head_dim in (64, 128, 256))
        all_paged = (window is not None and not self.prompts_read_cache and not fresh_window) or (
            backend.paged_prompts and not self.prompts_read_cache
                                           and kv_cache.dtype == torch.bfloat16 and not backend.amx_prefill) \
            or (backend.invariant and not self.prompts_read_cache and not is_quantized(kv_cache.dtype))
        self.prefill_min: int | None = (None if all_paged
                                        else 16 if self.prompts_read_cache else PREFILL_KERNEL_MIN)
        # Quantized pages without a window: whole fresh prompts attend over their own K/V (never rounded to
        # codes, as vLLM's prefill does) on the paged kernel, through a scratch cache of the activations' dtype
        # that holds just those prompts in rows of SCRATCH_BLOCK tokens, instead of torch's SDPA: bf16 where the
        # loops have bf16 dot products (SDPA's float32 products took 7% of the int8 engine's time on offline
        # sharegpt, Zen 5 EPYC), float32 where float caches send fresh prompts to the paged kernel too (AVX2
        # builds: one SDPA call per prompt per layer cost int8 pages ~5% of an offline sharegpt run on a Zen 3,
        # benchmarks/same_process.py, 2026-12-07).
        self.fresh_on_scratch = (((backend.paged_prompts and dtype == torch.bfloat16)
                                  or (backend.invariant and dtype == torch.float32))
                                 and not backend.amx_prefill and window is None and is_quantized(kv_cache.dtype))
        self.scratch_dtype = dtype

    def _plan(self, tables: torch.Tensor, qsl: torch.Tensor, lens: torch.Tensor, block_size: int | None = None):
        return self.ops.plan_attention(tables, qsl, lens, self.num_heads, self.num_blocks,
                                       block_size or self.block_size, self.window)

    def build(self, common: AttentionMetadata) -> CpuAttentionMetadata:
        if self.channel:
            if common.residual_block_tables is None:
                raise ValueError("int8 pages with keys per channel need the residual-key group's tables")
            n = common.num_seqs
            plan = self._plan(common.block_tables, common.query_start_loc, common.seq_lens, common.block_size)
            return CpuAttentionMetadata(common, False, False, n, int(common.query_start_loc[-1]), (), (), plan,
                                        channel=True)
        qlens, qsl = common.query_lens_list, common.query_start_loc
        n = len(qlens)
        minimum = self.prefill_min if self.prefill_min is not None else math.inf
        ns = next((i for i, q in enumerate(qlens) if q >= minimum), n)  # the runner put long chunks last
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        nc = ns
        while nc < n and common.seq_lens_list[nc] > qlens[nc]:  # chunks after cached keys come first
            nc += 1
        cached = tuple((starts[i], qlens[i]) for i in range(ns, nc))
        fresh = tuple((starts[i], qlens[i]) for i in range(nc, n))
        plan = self._plan(common.block_tables[:ns], qsl[: ns + 1], common.seq_lens[:ns]) if ns else None
        cached_plan = None
        if cached and not self.prompts_read_cache:
            r0 = starts[ns]
            cached_plan = self._plan(common.block_tables[ns:nc], qsl[ns : nc + 1] - r0, common.seq_lens[ns:nc])
        meta = CpuAttentionMetadata(common, self.packed, self.prompts_read_cache, ns, starts[ns], cached, fresh,
                                    plan, cached_plan, window=self.window)
        if fresh and self.fresh_on_scratch:
            self._plan_scratch(meta)
        return meta

    def _plan_scratch(self, meta: CpuAttentionMetadata) -> None:
        """The fresh prompts' plan over the scratch cache: prompt p in blocks [b_p, b_p + ceil(n_p / B))."""
        lens = [n for _, n in meta.fresh_prefills]
        counts = [-(-n // SCRATCH_BLOCK) for n in lens]
        firsts = [0, *accumulate(counts)]
        tables = torch.zeros(len(lens), max(counts), dtype=torch.long)
        for i, c in enumerate(counts):
            tables[i, :c] = torch.arange(firsts[i], firsts[i] + c)
        meta.fresh_first_rows = tuple(b * SCRATCH_BLOCK for b in firsts[:-1])
        meta.fresh_scratch = torch.empty(2, firsts[-1], SCRATCH_BLOCK, self.kv_heads, self.head_dim,
                                         dtype=self.scratch_dtype)
        meta.fresh_plan = self.ops.plan_attention(tables, torch.tensor([0, *accumulate(lens)]), torch.tensor(lens),
                                                  self.num_heads, firsts[-1], SCRATCH_BLOCK, None)


class CpuPagedAttention:
    name = "cpu"

    def __init__(self, ops: Kernels) -> None:
        self.ops = ops
        # The packed bf16, int8 and fp8 layouts unless the configuration keeps rows (kv_layout, for side-by-side
        # measurements).
        self.packed_ok = ops.packed_layout
        self.packed_int8_ok = ops.packed_int8_layout
        self.packed_fp8_ok = ops.packed_fp8_layout
        # Fresh prompts with AMX tile products where the CPU has them (1.6-2.5x torch's SDPA at 64-1000
        # tokens); amx_prefill=False keeps SDPA (side-by-side measurements).
        self.amx_prefill = ops.amx_prefill_ok
        # Prompt chunks after cached keys on that kernel too, reading the packed cache; prefill_cached=False
        # sends them to the paged kernel (side-by-side measurements, benchmarks/long_prompt.py).
        self.prefill_cached = self.amx_prefill and ops.config.prefill_cached
        # Without AMX, fresh prompts over bf16 caches on the paged kernel where its loops have AVX-512 BF16 dot
        # products (measured faster than SDPA there; AVX2 builds keep SDPA); paged_prompts=False keeps SDPA.
        self.paged_prompts = ops.config.paged_prompts and ops.bf16_dot
        # Batch-invariant attention (KVPAGE_BATCH_INVARIANT): whole fresh prompts on the paged kernel too, whose
        # every query row is the same bits whichever chunk of its prompt it comes in (SDPA's are not).
        self.invariant = ops.batch_invariant

    def packed_layout(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether a cache written and read with activations of `dtype` holds the packed layout: decided by the
        tensors alone, so every write and every read of one cache agree."""
        block_size, head_dim = kv_cache.shape[2], head_dim_of(kv_cache)
        if kv_cache.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):  # any activation dtype
            ok = self.packed_int8_ok if kv_cache.dtype == torch.int8 else self.packed_fp8_ok
            return ok and block_size % 16 == 0 and head_dim in (64, 128, 256)
        return (self.packed_ok and kv_cache.dtype == torch.bfloat16 and dtype == torch.bfloat16
                and block_size % 16 == 0 and head_dim in (64, 128, 256))

    def prompts_read_cache(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether long prompt chunks over this cache (fresh or after cached keys) go to the AMX prompt kernel
        that reads their keys from the packed cache (prefill_attention_paged)."""
        return (self.prefill_cached and kv_cache.dtype == torch.bfloat16 and self.packed_layout(kv_cache, dtype)
                and kv_cache.shape[4] in (64, 128, 256))

    def transform_rows(self, x: torch.Tensor, sub: torch.Tensor | None, mul: torch.Tensor | None, rotate: bool,
                       add: torch.Tensor | None) -> torch.Tensor:
        return self.ops.kv_affine_rows(x, sub, mul, rotate, add)

    def metadata_builder(self, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int,
                         window: int | None = None) -> CpuMetadataBuilder:
        return CpuMetadataBuilder(self, kv_cache, dtype, num_heads, window)

    def forward(self, query, key, value, kv_cache, meta: CpuAttentionMetadata, scale: float,
                key_feedback: torch.Tensor | None = None) -> torch.Tensor:
        ops, packed, common = self.ops, meta.packed, meta.common
        if meta.channel:
            if key_feedback is not None:
                raise ValueError("key rounding feedback is for int8 rows, not keys per channel")
            ops.reshape_and_cache_channel(key, value, kv_cache, common.slot_mapping, common.residual_slot_mapping,
                                          common.block_size)
            return ops.paged_attention_channel(query, kv_cache, meta.plan, common.residual_block_tables, scale)
        ops.reshape_and_cache(key, value, kv_cache, common.slot_mapping, packed, key_feedback)
        if meta.decode_only:
            return ops.paged_attention(query, kv_cache, meta.plan, scale, packed)
        out = torch.empty(query.shape, dtype=query.dtype)
        ns, nr = meta.paged_seqs, meta.paged_rows
        if ns > 0:
            out[:nr] = ops.paged_attention(query[:nr], kv_cache, meta.plan, scale, packed)
        prompts = meta.cached_prefills + meta.fresh_prefills
        if meta.prompts_read_cache:
            # every long prompt chunk, cached prefix or not, in one call reading its keys from the cache
            # (written just above): ops/csrc/attention/prefill_amx.cpp
            seqs = range(ns, ns + len(prompts))
            ops.prefill_attention_paged(query, kv_cache, common.block_tables, out, [s for s, _ in prompts],
                                        [n for _, n in prompts], [common.seq_lens_list[i] for i in seqs],
                                        list(seqs), scale, meta.window)
            return out
        if meta.cached_prefills:  # chunks after cached keys: the paged kernel over their slice of the batch
            r0 = meta.cached_prefills[0][0]
            r1 = meta.cached_prefills[-1][0] + meta.cached_prefills[-1][1]
            out[r0:r1] = ops.paged_attention(query[r0:r1], kv_cache, meta.cached_plan, scale, packed)
        if not meta.fresh_prefills:
            return out
        if meta.fresh_plan is not None:
            return self._fresh_on_scratch(query, key, value, out, meta, scale)
        if (self.amx_prefill and query.dtype == key.dtype == value.dtype == torch.bfloat16
                and query.shape[2] in (64, 128, 256)):
            # whole prompts, nothing cached: one call for all of them (ops/csrc/attention/prefill_amx.cpp)
            starts = [start for start, _ in meta.fresh_prefills]
            ops.prefill_attention(query, key, value, out, starts, [n for _, n in meta.fresh_prefills], scale,
                                  meta.window)
            return out
        gqa = query.shape[1] != key.shape[1]
        for start, n in meta.fresh_prefills:  # whole prompt, nothing cached: dense causal attention
            q = query[start : start + n].transpose(0, 1)[None]
            k = key[start : start + n].transpose(0, 1)[None].to(q.dtype)
            v = value[start : start + n].transpose(0, 1)[None].to(q.dtype)
            mask = None
            if meta.window is not None:  # query r sees keys r - window + 1 .. r
                back = torch.arange(n)[:, None] - torch.arange(n)[None, :]
                mask = (back >= 0) & (back < meta.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=gqa)
            out[start : start + n] = o[0].transpose(0, 1)
        return out

    def _fresh_on_scratch(self, query, key, value, out, meta: CpuAttentionMetadata, scale: float) -> torch.Tensor:
        """Whole fresh prompts over quantized pages: their own K/V copied into a bf16 scratch cache (rows) and
        read by the paged kernel under the step's fresh_plan."""
        cache = meta.fresh_scratch
        rows = cache.view(2, -1, *cache.shape[3:])
        for (start, n), row in zip(meta.fresh_prefills, meta.fresh_first_rows, strict=True):
            rows[0, row : row + n] = key[start : start + n]
            rows[1, row : row + n] = value[start : start + n]
        r0 = meta.fresh_prefills[0][0]
        r1 = meta.fresh_prefills[-1][0] + meta.fresh_prefills[-1][1]
        out[r0:r1] = self.ops.paged_attention(query[r0:r1], cache, meta.fresh_plan, scale, False)
        return out

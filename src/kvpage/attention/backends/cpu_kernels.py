"""The compiled CPU paged-attention backend (C++ / OpenMP, built on first use and cached).

The extension is compiled with torch's C++ extension machinery for this CPU (``-march=native``); the build
is cached under torch's extensions directory keyed by source, flags and CPU features. Without a working
compiler the engine logs why and falls back to the reference backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = [_CSRC / "paged_attention.cpp", _CSRC / "fused_ops.cpp", _CSRC / "quant_linear.cpp",
            _CSRC / "linear_amx.cpp", _CSRC / "prefill_amx.cpp", _CSRC / "decode_layers.cpp",
            _CSRC / "gemm_f32.cpp", _CSRC / "sampler.cpp"]
_module: ModuleType | None = None
_error: str | None = None
PARTITION_SIZE = 512  # tokens per context partition: long contexts split into this many keys per task


def _cpu_tag() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _headers_tag() -> str:
    """torch's build cache hashes only the listed sources; the headers' hash goes into the flags so that
    editing a header rebuilds too."""
    digest = hashlib.sha1()
    for h in sorted(_CSRC.glob("*.h")):
        digest.update(h.read_bytes())
    return digest.hexdigest()[:12]


STALE_LOCK_SECONDS = 600.0  # a build takes 1-5 min here; a lock this old was left by an interrupted one


def _check_build_lock(name: str) -> None:
    """torch's build waits for as long as the lock file of another build exists, and an interrupted build
    (Ctrl-C during the first start) leaves it behind: every later start would hang without a word. A lock
    older than STALE_LOCK_SECONDS is removed (so this start builds); a younger one is reported."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing a stale kernel build lock (%s, %.0f min old: an interrupted build)", lock, age / 60)
        lock.unlink(missing_ok=True)
    else:
        logger.warning("waiting for another process's kernel build (%s); if none is running, delete that file", lock)


def load_kernels() -> ModuleType | None:
    """The compiled module, or None (with the reason logged once) when it cannot be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load

        name = f"kvpage_paged_attention_{_cpu_tag()}"
        _check_build_lock(name)
        _module = load(name=name, sources=[str(p) for p in _SOURCES], extra_include_paths=[str(_CSRC)],
                       extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DKVPAGE_HEADERS={_headers_tag()}"],
                       extra_ldflags=["-fopenmp"], verbose=False)
        # AMX tile products for decode attention where the CPU and OS allow them; KVPAGE_AMX_DECODE=0 keeps
        # the AVX-512 kernel (for side-by-side measurements).
        _module.set_amx_decode(os.environ.get("KVPAGE_AMX_DECODE", "1") != "0")
        # One stream's short contexts cut over the threads; KVPAGE_SPLIT_SHORT=0 keeps one task per sequence.
        _module.set_split_short(os.environ.get("KVPAGE_SPLIT_SHORT", "1") != "0")
    except Exception as e:  # no compiler, no ninja, ...
        _error = f"{type(e).__name__}: {e}".splitlines()[0]
        logger.warning("compiled CPU kernels unavailable (%s): using the reference attention backend", _error)
    return _module


def kernels_error() -> str | None:
    return _error


# The packed bf16 KV layout (csrc/packed_kv.h): inside every block, groups of 16 keys per KV head hold K as
# [dim pairs][16 keys][2] and V as [key pairs][dim][2], the operand order of the dot-product instructions, so
# the attention kernel reads them as they are. The tensor's shape is the row layout's. These two functions
# convert whole caches between the layouts (tests, inspection); the engine only writes and reads through the
# kernels.
def pack_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """A row-layout cache [2, blocks, block_size, kv_heads, D] in the packed layout (a new tensor)."""
    _, nb, bs, kvh, d = rows.shape
    k = rows[0].reshape(nb, bs // 16, 16, kvh, d // 2, 2).permute(0, 1, 3, 4, 2, 5)
    v = rows[1].reshape(nb, bs // 16, 8, 2, kvh, d).permute(0, 1, 4, 2, 5, 3)
    return torch.stack([k.reshape(nb, bs, kvh, d), v.reshape(nb, bs, kvh, d)])


def unpack_kv_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_kv_rows."""
    _, nb, bs, kvh, d = packed.shape
    k = packed[0].reshape(nb, bs // 16, kvh, d // 2, 16, 2).permute(0, 1, 4, 2, 3, 5)
    v = packed[1].reshape(nb, bs // 16, kvh, 8, d, 2).permute(0, 1, 3, 5, 2, 4)
    return torch.stack([k.reshape(nb, bs, kvh, d), v.reshape(nb, bs, kvh, d)])


class CpuPagedAttention:
    name = "cpu"

    def __init__(self) -> None:
        self.ops = load_kernels()
        if self.ops is None:
            raise RuntimeError(f"compiled kernels unavailable: {_error}")
        # KVPAGE_KV_LAYOUT=rows keeps bf16 caches in the row layout (for side-by-side measurements).
        self.packed_ok = self.ops.has_packed_layout() and os.environ.get("KVPAGE_KV_LAYOUT", "packed") != "rows"
        # Fresh prompts with AMX tile products where the CPU has them (1.6-2.5x torch's SDPA at 64-1000
        # tokens); KVPAGE_AMX_PREFILL=0 keeps SDPA (side-by-side measurements).
        self.amx_prefill = os.environ.get("KVPAGE_AMX_PREFILL", "1") != "0" and self.ops.prefill_amx_available()
        # Prompt chunks after cached keys on that kernel too, reading the packed cache; KVPAGE_PREFILL_CACHED=0
        # sends them to the paged kernel as before (side-by-side measurements, benchmarks/long_prompt.py).
        self.prefill_cached = self.amx_prefill and os.environ.get("KVPAGE_PREFILL_CACHED", "1") != "0"

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
                                            scale, PARTITION_SIZE, packed)
        out = torch.empty(query.shape, dtype=query.dtype)
        ns, nr = meta.paged_seqs, meta.paged_rows
        if ns > 0:
            out[:nr] = self.ops.paged_attention(query[:nr], kv_cache, meta.block_tables[:ns],
                                                meta.query_start_loc[: ns + 1], meta.seq_lens[:ns], scale,
                                                PARTITION_SIZE, packed)
        prompts = meta.cached_prefills + meta.fresh_prefills
        if self.prompts_read_cache(kv_cache, query.dtype):
            # every long prompt chunk, cached prefix or not, in one call reading its keys from the cache
            # (written just above): csrc/prefill_amx.cpp
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
                                                  meta.seq_lens[ns : ns + nc], scale, PARTITION_SIZE, packed)
        if not meta.fresh_prefills:
            return out
        if self.amx_prefill and query.dtype == key.dtype == value.dtype == torch.bfloat16 and query.shape[2] == 64:
            # whole prompts, nothing cached: one call for all of them (csrc/prefill_amx.cpp)
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

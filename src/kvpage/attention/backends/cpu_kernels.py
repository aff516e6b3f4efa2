"""The compiled CPU paged-attention backend (C++ / OpenMP, built on first use and cached).

The extension is compiled with torch's C++ extension machinery for this CPU (``-march=native``); the build
is cached under torch's extensions directory keyed by source, flags and CPU features. Without a working
compiler the engine logs why and falls back to the reference backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = [_CSRC / "paged_attention.cpp", _CSRC / "fused_ops.cpp", _CSRC / "quant_linear.cpp"]
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


def load_kernels() -> ModuleType | None:
    """The compiled module, or None (with the reason logged once) when it cannot be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load

        name = f"kvpage_paged_attention_{_cpu_tag()}"
        _module = load(name=name, sources=[str(p) for p in _SOURCES], extra_include_paths=[str(_CSRC)],
                       extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DKVPAGE_HEADERS={_headers_tag()}"],
                       extra_ldflags=["-fopenmp"], verbose=False)
        # AMX tile products for decode attention where the CPU and OS allow them; KVPAGE_AMX_DECODE=0 keeps
        # the AVX-512 kernel (for side-by-side measurements).
        _module.set_amx_decode(os.environ.get("KVPAGE_AMX_DECODE", "1") != "0")
    except Exception as e:  # no compiler, no ninja, ...
        _error = f"{type(e).__name__}: {e}".splitlines()[0]
        logger.warning("compiled CPU kernels unavailable (%s): using the reference attention backend", _error)
    return _module


def kernels_error() -> str | None:
    return _error


class CpuPagedAttention:
    name = "cpu"

    def __init__(self) -> None:
        self.ops = load_kernels()
        if self.ops is None:
            raise RuntimeError(f"compiled kernels unavailable: {_error}")

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.ops.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        if not meta.fresh_prefills:
            return self.ops.paged_attention(query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                            scale, PARTITION_SIZE)
        out = torch.empty(query.shape, dtype=query.dtype)
        ns, nr = meta.paged_seqs, meta.paged_rows
        if ns > 0:
            out[:nr] = self.ops.paged_attention(query[:nr], kv_cache, meta.block_tables[:ns],
                                                meta.query_start_loc[: ns + 1], meta.seq_lens[:ns], scale,
                                                PARTITION_SIZE)
        gqa = query.shape[1] != key.shape[1]
        for start, n in meta.fresh_prefills:  # whole prompt, nothing cached: dense causal attention
            q = query[start : start + n].transpose(0, 1)[None]
            k = key[start : start + n].transpose(0, 1)[None].to(q.dtype)
            v = value[start : start + n].transpose(0, 1)[None].to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            out[start : start + n] = o[0].transpose(0, 1)
        return out

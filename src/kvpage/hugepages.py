"""Placing the packed weights on 2 MiB pages.

Why: every decode step streams the projection weights (~270 MB for SmolLM2 in bf16, ~100 MB of quantized
blocks for few-token steps) from memory, and with 4 KiB pages a TLB miss comes every 4 KiB of that stream.
On huge pages, decode steps of 1-32 sequences took 3-5% less time here (BENCHMARKS.md, session 14). Linux
gives anonymous memory huge pages in its "madvise" THP mode only where asked (MADV_HUGEPAGE) and only for
2 MiB-aligned stretches, so the weights are copied into one aligned arena.

Not the KV pool: the pool is faulted in lazily, as the engine first writes it, and on this VM a fresh huge
page costs ~2 ms per MB to fault in, against ~0.2 for small pages. Whole paged_vs_static runs lost 2-5% that
way, more than the faster reads gave (a prefaulted pool read ~5% faster in the decode kernel).

Everything here degrades to a no-op where the kernel says no (THP off, not Linux): results never depend on
it. ``KVPAGE_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in (writable) without changing their contents
PAGE = 4096
HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor in the arena starts on a cache line (the kernels' vector loads like that)


def enabled() -> bool:
    return os.environ.get("KVPAGE_HUGE_PAGES", "1") != "0"


def madvise_fn():
    """libc's madvise, or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def advise(tensors: Sequence[torch.Tensor], advice: int) -> bool:
    """madvise(advice) over the whole pages of each tensor's storage; False if any call failed."""
    fn = madvise_fn()
    ok = fn is not None
    for t in tensors:
        if t.numel() == 0:
            continue
        start = t.data_ptr() // PAGE * PAGE
        end = t.data_ptr() + t.numel() * t.element_size()
        if fn is None or fn(start, end - start, advice) != 0:
            ok = False
    return ok


def huge_page_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Contiguous copies of ``tensors`` (same dtypes, shapes and values), packed into one 2 MiB-aligned byte
    arena on huge pages, in order. The originals are left alone; drop them to free their memory. None where
    huge pages are off or refused."""
    if not enabled() or not tensors:
        return None
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    arena = raw[skip: skip + total]
    if not advise([arena], MADV_HUGEPAGE):
        return None
    out = []
    for t, off in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        view = arena[off: off + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out

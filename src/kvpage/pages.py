"""Memory pages under the engine's large tensors: 2 MiB pages where Linux gives them, and prefaulting.

Why: the two kinds of memory a step streams are both far larger than the TLB covers on 4 KiB pages. A
sequence's KV blocks lie scattered over the pool, so nearly every block read is a TLB miss; and a step reads
every packed weight once (~270 MB for SmolLM2-135M in bf16), a page walk every 4 KiB, which also stalls the
kernels' software prefetches of the next weight block (AMX Xeon, 2026-11-29, `benchmarks/linear.py --pages`:
a pass of SmolLM2's layer projections on the tile GEMM at 16-256 rows 0.73-0.85x the time on 2 MiB pages, the
lm head 0.70-0.80x at 16-128 rows; docs/model.md). Where transparent huge pages are off, or madvise fails,
nothing changes but the page size.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in (writable) without changing their contents
_PAGE = 4096
HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor of an arena starts on a cache line (the tile loads' operands)


def thp_mode() -> str | None:
    """Linux's transparent huge page mode ("always", "madvise" or "never"), or None where it is not reported."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def advise_huge_pages(tensors: Sequence[torch.Tensor]) -> int:
    """Ask for 2 MiB pages under the tensors (before their pages are first touched); returns the bytes
    advised: the whole 2 MiB pages inside each tensor."""
    madvise = _madvise()
    if madvise is None:
        return 0
    advised = 0
    for t in tensors:
        begin = t.data_ptr()
        end = begin + t.numel() * t.element_size()
        lo, hi = -(-begin // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi > lo and madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0:
            advised += hi - lo
    return advised


def prefault_pages(tensors: Sequence[torch.Tensor]) -> str:
    """Fault every page of the tensors in now; returns how ("madvise" or "zero-fill"). Contents are not
    meaningful before the engine writes them either way."""
    madvise = _madvise()
    how = "madvise"
    for t in tensors:
        if t.numel() == 0:
            continue
        start = t.data_ptr() // _PAGE * _PAGE
        length = t.data_ptr() + t.numel() * t.element_size() - start
        if madvise is None or madvise(start, length, _MADV_POPULATE_WRITE) != 0:
            t.zero_()  # older kernels: touching every page does the same, a little slower
            how = "zero-fill"
    return how


def gather_on_huge_pages(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Copies of contiguous tensors, in order, packed one after another into one arena that starts on a 2 MiB
    boundary and is advised onto 2 MiB pages before it is written; returns (copies, bytes advised).

    One arena rather than a buffer each: most weight matrices of a small model are under 2 MiB (SmolLM2's
    q|k|v is 1.1 MB), so only their concatenation fills whole huge pages; in the order given (the order a
    step reads them) a forward pass streams one run of memory. Each copy keeps the arena alive."""
    offsets, size = [], 0
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("gather_on_huge_pages takes contiguous tensors")
        size = -(-size // _ALIGN) * _ALIGN
        offsets.append(size)
        size += t.numel() * t.element_size()
    if size == 0:
        return list(tensors), 0
    span = -(-size // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # room to start on a 2 MiB boundary
    start = -raw.data_ptr() % HUGE_PAGE
    arena = raw[start : start + span]
    advised = advise_huge_pages([arena])
    out = []
    for t, off in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        out.append(arena[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t))
    return out, advised

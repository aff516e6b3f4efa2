"""Freed heap handed back to the operating system while the engine is idle.

Why: a step's large tensors (a prompt step's activations, gathered logits) come and go, and glibc serves
them from its heap once its adaptive mmap threshold has risen past their size; when they are freed, the pages
stay with the process. A tensor-parallel server under mixed traffic grew each rank by ~300 MiB in five
minutes that way (docs/tensor_parallel.md), none of it in use. ``malloc_trim(0)`` returns every whole free
page inside the heaps (madvise), which costs a walk over the free chunks (17-40 ms after a spell of 64
requests), so the server does it once it has been idle for a while, never between the steps of a busy engine.
Elsewhere (another C library) nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from functools import lru_cache

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _malloc_trim() -> ctypes._CFuncPtr | None:  # glibc's malloc_trim, or None elsewhere
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    fn = getattr(libc, "malloc_trim", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_size_t]
        fn.restype = ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return the heaps' free pages to the OS; True when the C library has malloc_trim (glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    t0 = time.perf_counter()
    fn(0)
    logger.debug("malloc_trim: %.1f ms", (time.perf_counter() - t0) * 1e3)
    return True

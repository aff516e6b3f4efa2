"""Whether the compiled kernels (or one AMX kernel of theirs) can run here: a build error fails, never skips."""

from __future__ import annotations

import pytest


def have_cxx() -> bool:
    """A C++ compiler is present, so the kernels must build: a build error fails the kernel tests, never skips."""
    import shutil

    return any(shutil.which(c) for c in ("c++", "g++", "clang++"))


def amx_ops(available: str):
    """The compiled kernels when `ops.<available>()` says its AMX kernel can run here; the test is skipped
    otherwise (no compiler, or a CPU/OS without AMX tiles)."""
    if not have_cxx():
        pytest.skip("no C++ compiler: kernels cannot be built")
    from kvpage.ops import load_kernels

    ops = load_kernels()
    if ops is None or not getattr(ops, available)():
        pytest.skip("AMX tile products unavailable on this CPU/OS")
    return ops

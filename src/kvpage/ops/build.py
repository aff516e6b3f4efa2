"""Building kvpage's compiled kernels (C++ / OpenMP, csrc/): on first use, cached, once per process.

The extension is compiled with torch's C++ extension machinery for this CPU (``-march=native``); the build
is cached under torch's extensions directory, one build per version of the sources and CPU (``_sources_tag``,
``_cpu_tag``). Without a working
compiler ``load_kernels`` returns None and logs why; the engine then runs the reference backend and torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = sorted(_CSRC.rglob("*.cpp"))  # bindings.cpp and every kernel it binds
_module: ModuleType | None = None
_error: str | None = None


def _cpu_tag() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _sources_tag() -> str:
    """A hash of every source and header, in the build's name: each version of the kernels gets its own build
    directory, so two checkouts (a benchmark against an earlier commit) never rebuild over each other, and
    editing a header rebuilds too (torch's cache hashes only the listed sources)."""
    digest = hashlib.sha1()
    for f in sorted(_CSRC.rglob("*")):
        if f.suffix in (".cpp", ".h"):
            digest.update(str(f.relative_to(_CSRC)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:10]


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

        name = f"kvpage_kernels_{_cpu_tag()}_{_sources_tag()}"
        _check_build_lock(name)
        _module = load(name=name, sources=[str(p) for p in _SOURCES], extra_include_paths=[str(_CSRC)],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, ...
        _error = f"{type(e).__name__}: {e}".splitlines()[0]
        logger.warning("compiled CPU kernels unavailable (%s): using the reference attention backend", _error)
    return _module


def kernels_error() -> str | None:
    return _error

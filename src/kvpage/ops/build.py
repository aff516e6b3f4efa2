"""Building kvpage's compiled kernels (C++ / OpenMP, csrc/): on first use, cached, once per process.

The extension is compiled with torch's C++ extension machinery for this CPU (``-march=native``); the build
is cached under torch's extensions directory, one build per version of the sources and CPU (``_sources_tag``,
``_cpu_tag``). A first build compiles ATen's headers once into a GCC precompiled header (``_precompile``) that
every source then loads instead of parsing them again. Without a working compiler ``load_kernels`` returns
None and logs why; the engine then runs the reference backend and torch.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from kvpage.cpuinfo import cpuinfo_field

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = sorted(_CSRC.rglob("*.cpp"))  # bindings.cpp and every kernel it binds
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_PCH = "kvpage_pch.h"  # in the build directory; its compiled form (.gch) lives there only during a build
_PCH_TEXT = "// ATen's headers, precompiled for the kernels' build (ops/build.py)\n#include <ATen/ATen.h>\n"
_module: ModuleType | None = None
_error: str | None = None


def _cpu_tag() -> str:
    flags = cpuinfo_field("flags") or os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _sources_tag() -> str:
    """A hash of every source and header (and the build's flags), in the build's name: each version of the
    kernels gets its own build directory, so two checkouts (a benchmark against an earlier commit) never
    rebuild over each other, and editing a header rebuilds too (torch's cache hashes only the listed sources)."""
    digest = hashlib.sha1(" ".join([*_CFLAGS, "-include", _PCH]).encode())  # and the build's own flags
    for f in sorted(_CSRC.rglob("*")):
        if f.suffix in (".cpp", ".h"):
            digest.update(str(f.relative_to(_CSRC)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def build_tag() -> str:
    """This machine's build of the kernels: its CPU's flags and the sources' hash, in the build's name and in
    what a result computed with them depends on (calibrated KV transforms). Hashed once per process."""
    return f"{_cpu_tag()}_{_sources_tag()}"


@contextmanager
def _build_lock(name: str) -> Iterator[Path]:
    """Serializes kernel builds across processes with a lock the kernel drops when its holder dies.

    Why: torch's own build lock is a plain file, and its waiters poll for as long as the file exists. A process
    killed while it holds that file (Ctrl-C during the first build; a server stopped while it checks its build,
    as tests do) leaves it behind, and every later start waits forever without a word. Every kvpage process
    takes this flock around torch's build; whoever holds it knows that no live kvpage process holds torch's
    file, so a file found then is an orphan and is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kvpage.flock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process's kernel build (%s)", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        orphan = build_dir / "lock"
        if orphan.exists():
            logger.warning("removing an orphaned kernel build lock (%s): an interrupted build", orphan)
            orphan.unlink(missing_ok=True)
        yield build_dir  # closing the file lets go of the flock


def _compile_flags(name: str) -> list[str]:
    """The flags torch's build gives each source (its build.ninja's cflags, in order), for the precompiled
    header: GCC takes a .gch only from a compile with the same options, and silently parses the header text
    otherwise (tests/ops/test_kernels.py holds the two lists equal)."""
    from torch.utils.cpp_extension import include_paths

    flags = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{_CSRC}"]
    for inc in [*include_paths(), sysconfig.get_paths()["include"]]:
        flags += ["-isystem", inc]
    return [*flags, "-fPIC", "-std=c++20", *_CFLAGS]


def _precompile(name: str, build_dir: Path) -> Path | None:
    """Compiles ATen's headers into build_dir/kvpage_pch.h.gch before a build, where none is built yet.

    Why: every kernel source includes ATen, and parsing its headers was ~20 of the ~30 s each of the 17
    sources took to compile (the family-23 EPYC, 2026-12-02); the .gch is ~0.4 GB, so it is deleted after
    the build. Each source gets ``-include kvpage_pch.h`` whether or not it exists (the flags stay the same, so
    torch does not see a change and rebuild); without the .gch GCC reads the header's one line as text."""
    header = build_dir / _PCH
    if not header.exists() or header.read_text() != _PCH_TEXT:
        header.write_text(_PCH_TEXT)
    if (build_dir / f"{name}.so").exists():
        return None  # built already: torch loads it (or rebuilds a changed source without the header)
    gch = build_dir / f"{_PCH}.gch"
    cmd = [os.environ.get("CXX", "c++"), *_compile_flags(name), "-x", "c++-header", str(header), "-o", str(gch)]
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        logger.info("no precompiled header (%s): the build parses ATen's headers per source", e)
        gch.unlink(missing_ok=True)
        return None
    logger.info("precompiled ATen's headers in %.1f s", time.monotonic() - t0)
    return gch


def load_kernels() -> ModuleType | None:
    """The compiled module, or None (with the reason logged once) when it cannot be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load

        name = f"kvpage_kernels_{build_tag()}"
        with _build_lock(name) as build_dir:
            gch = _precompile(name, build_dir)
            try:
                _module = load(name=name, sources=[str(p) for p in _SOURCES], extra_include_paths=[str(_CSRC)],
                               extra_cflags=[*_CFLAGS, "-include", str(build_dir / _PCH)],
                               extra_ldflags=["-fopenmp"], verbose=False)
            finally:
                if gch is not None:
                    gch.unlink(missing_ok=True)
    except Exception as e:  # no compiler, no ninja, ...
        _error = f"{type(e).__name__}: {e}".splitlines()[0]
        logger.warning("compiled CPU kernels unavailable (%s): using the reference attention backend", _error)
    return _module


def kernels_error() -> str | None:
    return _error

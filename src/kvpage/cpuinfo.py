"""What /proc/cpuinfo says about this machine's CPU, read once per process (stdlib only).

Why one place: the kernel build's cache tag, the default dtype, the GEMM choice and the benchmarks' machine
line all ask the same file for one field each.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _first_cpu() -> dict[str, str]:
    """The fields of the first processor's block; empty where the file is missing (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpuinfo_field(name: str) -> str:
    """One field of the first processor ('flags', 'vendor_id', 'model name', ...); '' where there is none."""
    return _first_cpu().get(name, "")


def cpu_flags() -> set[str]:
    return set(cpuinfo_field("flags").split())

"""Byte sizes on the command line (``8GiB``, ``512MiB``, ``1.5GB``) and in reports."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``8GiB`` / ``512MiB`` / ``2G`` (binary) / ``1.5GB`` (decimal) / ``4096`` (bytes)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: use a number with a unit such as 8GiB, 512MiB, 1.5GB or 4096 (bytes)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Largest binary unit, at most two decimals: 327680 -> '320 KiB', 1342177280 -> '1.25 GiB'."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{_trim(n / size)} {unit}"
    return f"{_trim(n)} B"


def _trim(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")

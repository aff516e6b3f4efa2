"""The backend seam: every backend implements ``forward(q, k, v, kv_cache, meta, scale)``."""

from __future__ import annotations

from kvpage.attention.backends.base import AttentionBackend
from kvpage.attention.backends.reference import ReferenceAttention

_BACKENDS: dict[str, type[AttentionBackend]] = {"reference": ReferenceAttention}


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """``auto``: the compiled CPU kernels when they build here, else the reference backend (logged)."""
    if name in ("auto", "cpu"):
        from kvpage.attention.backends.cpu_kernels import CpuPagedAttention, load_kernels

        if load_kernels() is not None:
            return CpuPagedAttention()
        if name == "cpu":
            from kvpage.attention.backends.cpu_kernels import kernels_error

            raise RuntimeError(f"the compiled CPU backend is unavailable: {kernels_error()}")
        return ReferenceAttention()
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}: choose auto, cpu or {', '.join(_BACKENDS)}"
        ) from None


__all__ = ["AttentionBackend", "ReferenceAttention", "get_attention_backend"]

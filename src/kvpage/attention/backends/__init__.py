"""The backend seam: every backend implements ``forward(q, k, v, kv_cache, meta, scale)``."""

from __future__ import annotations

from kvpage.attention.backends.base import AttentionBackend
from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.envs import KernelConfig

_BACKENDS: dict[str, type[AttentionBackend]] = {"reference": ReferenceAttention}


def get_attention_backend(name: str = "auto", config: KernelConfig | None = None) -> AttentionBackend:
    """``auto``: the compiled CPU kernels (under ``config``) when they build here, else the reference backend
    (logged)."""
    if name in ("auto", "cpu"):
        from kvpage.ops import kernels, kernels_error

        ops = kernels(config)
        if ops is not None:
            from kvpage.attention.backends.cpu import CpuPagedAttention

            return CpuPagedAttention(ops)
        if name == "cpu":
            raise RuntimeError(f"the compiled CPU backend is unavailable: {kernels_error()}")
        return ReferenceAttention()
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}: choose auto, cpu or {', '.join(_BACKENDS)}"
        ) from None


__all__ = ["AttentionBackend", "ReferenceAttention", "get_attention_backend"]

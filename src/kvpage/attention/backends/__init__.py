"""The backend seam: every backend implements ``forward(q, k, v, kv_cache, meta, scale)``."""

from __future__ import annotations

from kvpage.attention.backends.base import AttentionBackend
from kvpage.attention.backends.reference import ReferenceAttention

_BACKENDS: dict[str, type[AttentionBackend]] = {"reference": ReferenceAttention}


def get_attention_backend(name: str = "reference") -> AttentionBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(_BACKENDS)}") from None


__all__ = ["AttentionBackend", "ReferenceAttention", "get_attention_backend"]

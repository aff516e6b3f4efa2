"""Attention metadata and backends: how a flat batch reads and writes the paged KV cache."""

from kvpage.attention.backends import get_attention_backend
from kvpage.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_attention_backend"]

"""kvpage: an LLM inference and serving engine built around a paged KV cache."""

__version__ = "0.1.0"

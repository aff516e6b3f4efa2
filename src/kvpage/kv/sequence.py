"""What the KV manager needs to know about a sequence.

``core/`` has the scheduler's richer sequence type; anything with these attributes will do, so the
bookkeeping stays independent of the scheduler (and of torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class SequenceLike(Protocol):
    @property
    def seq_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]:
        """Every token known so far (prompt, then output), including ones not yet computed."""
        ...

    @property
    def cache_salt(self) -> str | None:
        """Isolates this sequence's prefix-cache entries from other salts (None: shared)."""
        ...

    @property
    def adapter_id(self) -> str | None:
        """The model adapter whose K/V this is (a prefix-cache isolation key, like the salt)."""
        ...

    @property
    def max_total_tokens(self) -> int | None:
        """Prompt + max_tokens, where known: what a static reservation sizes itself by."""
        ...


@dataclass
class KVSequence:
    """Minimal sequence for the trace tool, the simulator and tests."""

    seq_id: str
    token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    adapter_id: str | None = None
    max_total_tokens: int | None = None

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


@dataclass
class KVSequence:
    """Minimal sequence for the trace tool, the simulator and tests."""

    seq_id: str
    token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    adapter_id: str | None = None

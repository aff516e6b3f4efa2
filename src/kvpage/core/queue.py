"""The scheduler's queues: sequences kept in scheduling order (pure Python)."""

from __future__ import annotations

import bisect

from kvpage.core.sequence import Sequence


class SeqQueue:
    """Sequences kept sorted by (priority, arrival, sample index)."""

    def __init__(self) -> None:
        self.items: list[Sequence] = []
        self._keys: list[tuple[int, int, int]] = []

    def add(self, seq: Sequence) -> None:
        k = seq.sort_key
        i = bisect.bisect_right(self._keys, k)
        self.items.insert(i, seq)
        self._keys.insert(i, k)

    def remove(self, seq: Sequence) -> bool:
        for i, s in enumerate(self.items):
            if s is seq:
                del self.items[i], self._keys[i]
                return True
        return False

    def pop(self, i: int = -1) -> Sequence:
        del self._keys[i]
        return self.items.pop(i)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Sequence:
        return self.items[i]

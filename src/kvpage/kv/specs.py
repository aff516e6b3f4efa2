"""KV groups: which layers keep which kind of KV, and how they share one pool of equal blocks.

A KV spec says what a layer keeps: every past position (full attention), the last ``window`` positions
(sliding window), or, beside an int8 page group whose keys are rounded per channel once a block is complete,
the *residual*: the keys of the block still filling, unrounded (kv/residual.py). Layers of one spec are cut
into groups of equal size, the same size for every spec (the greatest common divisor of the specs' layer
counts), so that a block of any group is the same number of bytes: ``layers_per_group`` layer-pages of
``block_size`` tokens. One pool of such blocks then serves every group under one budget, and the worker keeps
``layers_per_group`` KV tensors; layer ``l`` lives in tensor ``slot(l)`` and reads the block table of
``group(l)``. A block belongs to one group at a time, so layers of different groups sharing a tensor never
meet. A model of one spec is one group of all its layers: one tensor per layer, as before.

Gemma 3 270M: 15 sliding layers and 3 full ones make six groups of three layers (five sliding, one full).
With residual keys (``with_residual_keys``) each of those groups gets a residual group over the same layers
(the same tensors), appended after them: twelve groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KVSpec:
    """What one layer keeps. ``window``: a sliding window of that many positions (a query sees itself and
    window - 1 positions back); None: full attention. ``residual``: the unrounded keys of each sequence's
    filling block for the group of the same layers (no attention of its own; it holds what a window of one
    position would, the block the next position lands in)."""

    window: int | None = None
    residual: bool = False

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"a sliding window must be a positive number of positions, got {self.window!r}")
        if self.residual and self.window is not None:
            raise ValueError("a residual-key spec has no window of its own")

    @property
    def kind(self) -> str:
        if self.residual:
            return "residual"
        return "full" if self.window is None else f"sliding({self.window})"

    def max_blocks(self, block_size: int, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` holds at most between steps in a group of this spec: all of them,
        those the next query's window reaches (ceil((W - 1) / block_size) + 1), or the filling one."""
        full = -(-num_tokens // block_size)
        if self.residual:
            return min(full, 1)
        if self.window is None:
            return full
        return min(full, -(-(self.window - 1) // block_size) + 1)


@dataclass(frozen=True)
class KVGroup:
    spec: KVSpec
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    """The KV groups of a model, and where each layer's KV lives."""

    groups: tuple[KVGroup, ...]
    num_layers: int

    @property
    def layers_per_group(self) -> int:
        """KV tensors the worker keeps; a pool block spans this many layer-pages."""
        return len(self.groups[0].layers)

    def group(self, layer: int) -> int:
        return self._where[layer][0]

    def slot(self, layer: int) -> int:
        return self._where[layer][1]

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {layer: (g, i) for g, grp in enumerate(self.groups) if not grp.spec.residual
                for i, layer in enumerate(grp.layers)}

    @cached_property
    def residual_of(self) -> dict[int, int]:
        """Attention group -> the residual group over its layers (empty without residual keys)."""
        first = {grp.layers[0]: g for g, grp in enumerate(self.groups) if not grp.spec.residual}
        return {first[grp.layers[0]]: g for g, grp in enumerate(self.groups) if grp.spec.residual}

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for g in self.groups:
            kinds[g.spec.kind] = kinds.get(g.spec.kind, 0) + 1
        return ", ".join(f"{n} {k} group{'s' if n > 1 else ''}" for k, n in kinds.items()) + \
            f" of {self.layers_per_group} layers"


def group_layers(windows: Sequence[int | None]) -> KVLayout:
    """The KV layout of layers with these windows (None: full attention), specs in order of first appearance."""
    if not windows:
        raise ValueError("a model needs at least one layer")
    by_spec: dict[KVSpec, list[int]] = {}
    for layer, window in enumerate(windows):
        by_spec.setdefault(KVSpec(window), []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_spec.values()))
    groups = tuple(KVGroup(spec, tuple(layers[i : i + size]))
                   for spec, layers in by_spec.items() for i in range(0, len(layers), size))
    return KVLayout(groups, len(windows))


def with_residual_keys(layout: KVLayout) -> KVLayout:
    """``layout`` plus one residual-key group per group, over the same layers (and so the same tensors)."""
    if any(g.spec.residual for g in layout.groups):
        return layout
    extra = tuple(KVGroup(KVSpec(residual=True), g.layers) for g in layout.groups)
    return KVLayout(layout.groups + extra, layout.num_layers)


def single_group(num_layers: int, window: int | None = None) -> KVLayout:
    return group_layers([window] * num_layers)

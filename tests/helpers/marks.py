"""Parameters left to `-m slow`: the default run keeps one of each parametrized case."""

from __future__ import annotations

import pytest


def slow(*values: object) -> object:
    """A parameter set that runs only under `-m slow`."""
    return pytest.param(*values, marks=pytest.mark.slow)

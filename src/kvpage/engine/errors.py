"""Errors the engine reports to its callers (the offline API and the server's engine client)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine failed in a way that poisons every request (a failed model step, a bug in a step): it
    accepts nothing more. The server exits non-zero on it so that a supervisor restarts it."""

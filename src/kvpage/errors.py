"""The errors kvpage reports to its callers, typed so that each caller can map them (the server to HTTP codes,
the CLI to a message and an exit code) without matching message text.

Two families: a refused request (``RequestRejected``, a ``ValueError``) leaves the engine exactly as it was,
nothing allocated; an engine-level state (queue full, shutting down, dead) says nothing about the request.
Torch-free: the scheduler raises some of these.
"""

from __future__ import annotations


class RequestRejected(ValueError):
    """The engine refused a request before taking it: nothing was allocated, nothing else changed.
    ``param`` names the input at fault (``prompt``, ``max_tokens``, ...) where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequestError(RequestRejected):
    """A prompt or sampling setting the engine cannot take as given (empty prompt, token id outside the
    vocabulary, max_tokens beyond the context)."""


class PromptTooLongError(RequestRejected):
    """The prompt alone fills max_model_len: no room is left to generate."""

    def __init__(self, prompt_len: int, max_model_len: int) -> None:
        super().__init__(f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
                         f"max_model_len={max_model_len}", "prompt")
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len


class KVCapacityError(RequestRejected):
    """The request, grown to its longest, would need more KV blocks than the whole pool holds: it could never
    finish, so it is refused instead of blocking the queue."""


class RequestIdInUseError(RequestRejected):
    """Another open request already has this id."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the request was not looked at. Retry later."""


class ShuttingDownError(RuntimeError):
    """The engine is draining for shutdown and takes no new requests."""


class EngineDeadError(RuntimeError):
    """The engine failed in a way that poisons every request (a failed model step, a bug in a step): it
    accepts nothing more. The server exits non-zero on it so that a supervisor restarts it."""

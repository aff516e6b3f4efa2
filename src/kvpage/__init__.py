"""kvpage: an LLM inference and serving engine built around a paged KV cache.

The public surface, as vLLM's: ``from kvpage import LLM, SamplingParams, RequestOutput``. The names load on
first use, so that importing a torch-free part (``kvpage.kv``, ``kvpage.core``) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "kvpage.engine.llm",
    "LLMEngine": "kvpage.engine.llm_engine",
    "EngineArgs": "kvpage.engine.arg_utils",
    "SamplingParams": "kvpage.sampling_params",
    "RequestOutput": "kvpage.outputs",
    "CompletionOutput": "kvpage.outputs",
    "EngineDeadError": "kvpage.errors",
}
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "EngineDeadError", "LLMEngine", "RequestOutput", "SamplingParams",
           "__version__"]

if TYPE_CHECKING:
    from kvpage.engine.arg_utils import EngineArgs
    from kvpage.engine.llm import LLM
    from kvpage.engine.llm_engine import LLMEngine
    from kvpage.errors import EngineDeadError
    from kvpage.outputs import CompletionOutput, RequestOutput
    from kvpage.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")

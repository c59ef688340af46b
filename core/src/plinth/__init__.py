"""plinth: an LLM inference and serving platform (the core).

``import plinth`` is cheap; the engine (and torch) load on first use of
``plinth.LLM`` or ``plinth.SamplingParams``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "plinth.engine.llm",
    "SamplingParams": "plinth.engine.sampling_params",
    "RequestOutput": "plinth.engine.outputs",
    "CompletionOutput": "plinth.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'plinth' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]

"""kvprefix: a prefix-caching LLM engine and OpenAI-compatible server.

``from kvprefix import LLM, SamplingParams`` works as with vLLM. They load lazily, so ``import kvprefix.cache``
(routers, the planner) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"LLM": "kvprefix.engine", "SamplingParams": "kvprefix.engine", "AsyncLLM": "kvprefix.engine",
         "LoRARequest": "kvprefix.engine", "BeamSearchParams": "kvprefix.engine"}
__all__ = ["AsyncLLM", "BeamSearchParams", "LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvprefix' has no attribute {name!r}")

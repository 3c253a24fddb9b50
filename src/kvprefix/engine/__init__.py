"""The inference engine: requests, scheduler, model runner, sampler, and the LLM / AsyncLLM APIs.

The torch-free parts import eagerly; LLM, AsyncLLM and LLMEngine load torch only when first used (fast CLI start).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvprefix.engine.args import EngineArgs
from kvprefix.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvprefix.engine.lora_request import LoraNotFoundError, LoRARequest
from kvprefix.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from kvprefix.engine.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "kvprefix.engine.llm",
    "AsyncLLM": "kvprefix.engine.async_llm",
    "EngineClient": "kvprefix.engine.client",
    "EngineDeadError": "kvprefix.engine.async_llm",
    "LLMEngine": "kvprefix.engine.llm_engine",
    "RequestFailedError": "kvprefix.engine.llm_engine",
}

__all__ = [
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "EngineClient",
    "EngineDeadError",
    "LLM",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "LoraNotFoundError",
    "RequestMetrics",
    "RequestFailedError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvprefix.engine' has no attribute {name!r}")

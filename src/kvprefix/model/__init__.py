"""Llama-family models over a paged KV cache: loading, attention, streaming detokenization, and the built-in default model.

The names below load their module on first use (PEP 562): `kvprefix.model.default_model_path`, which the doctor,
router and planner use to find the default model's tokenizer, must not import torch and the model code with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULE_OF = {
    "AttentionMetadata": "attention",
    "KVCache": "attention",
    "allocate_kv_cache": "attention",
    "kv_cache_bytes_per_block": "attention",
    "ModelConfig": "config",
    "default_model_path": "default_model",
    "CausalLM": "llama",
    "load_model": "loader",
    "write_random_checkpoint": "random_checkpoint",
}
__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "allocate_kv_cache",
    "default_model_path",
    "kv_cache_bytes_per_block",
    "load_model",
    "write_random_checkpoint",
]

if TYPE_CHECKING:
    from kvprefix.model.attention import AttentionMetadata, KVCache, allocate_kv_cache, kv_cache_bytes_per_block
    from kvprefix.model.config import ModelConfig
    from kvprefix.model.default_model import default_model_path
    from kvprefix.model.llama import CausalLM
    from kvprefix.model.loader import load_model
    from kvprefix.model.random_checkpoint import write_random_checkpoint


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value

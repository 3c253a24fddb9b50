"""Llama-family models over a paged KV cache: loading, attention, streaming detokenization, and the built-in default model."""

from kvprefix.model.attention import AttentionMetadata, KVCache, allocate_kv_cache, kv_cache_bytes_per_block
from kvprefix.model.config import ModelConfig
from kvprefix.model.default_model import default_model_path
from kvprefix.model.llama import CausalLM
from kvprefix.model.loader import load_model
from kvprefix.model.random_checkpoint import write_random_checkpoint
from kvprefix.model.tokenizer import IncrementalDetokenizer

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "IncrementalDetokenizer",
    "KVCache",
    "ModelConfig",
    "allocate_kv_cache",
    "default_model_path",
    "kv_cache_bytes_per_block",
    "load_model",
    "write_random_checkpoint",
]

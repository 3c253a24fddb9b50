"""Llama-family models over a paged KV cache: configuration, loading (safetensors and GGUF), attention, compact
weights, and random checkpoints for tests and benchmarks. Uses torch; the engine is its one consumer."""

from kvprefix.model.attention import AttentionMetadata, KVCache, allocate_kv_cache, kv_cache_bytes_per_block
from kvprefix.model.config import ModelConfig
from kvprefix.model.llama import CausalLM
from kvprefix.model.loader import load_model
from kvprefix.model.random_checkpoint import write_random_checkpoint, write_random_lora_adapter

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "allocate_kv_cache",
    "kv_cache_bytes_per_block",
    "load_model",
    "write_random_checkpoint",
    "write_random_lora_adapter",
]

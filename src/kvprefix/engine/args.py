"""EngineArgs: every engine setting, with vLLM's names. Pure Python, so the server's CLI can build one cheaply."""

from __future__ import annotations

from dataclasses import dataclass

from kvprefix.cache.identity import QUANTIZATION_CHOICES  # noqa: F401  (the CLI's --quantization choices)
from kvprefix.tiers.redis_store import DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT

DEFAULT_KV_DISK_SIZE = "10GiB"


@dataclass
class EngineArgs:
    """``model`` None: the built-in default model. ``dtype`` "auto": bfloat16 on CUDA and native-bfloat16 CPUs, else
    float32. KV cache size: ``num_gpu_blocks`` if given, else ``kv_cache_memory`` bytes, else (CUDA)
    ``gpu_memory_utilization`` of free memory or (CPU) 1 GiB. ``max_model_len`` None: the model's
    ``max_position_embeddings``. ``tenant_kv_reserve`` > 0: that fraction of the cache is reserved per tenant
    (docs/security.md). ``share_inflight_prefixes``: wait (bounded) for prompt blocks a running request is computing.
    ``scheduling_policy``: "fcfs" or "cache_aware" (most cached first, bounded by ``max_wait_steps``;
    docs/engine.md). ``quantization`` (CPU only): "int8", "int4" or "gguf" compact weights, "none" dense; None: a
    quantized .gguf file's own blocks where the CPU runs them natively, else dense (docs/model.md).
    ``kv_disk``: a directory for the persistent KV tier, at most ``kv_disk_size`` (bytes, or "20GiB"), writes
    queued up to ``kv_disk_queue`` blocks (docs/tiers.md). ``kv_shared``: a ``redis://`` URL for the shared tier
    (keys under ``kv_shared_prefix``, each call bounded by ``kv_shared_timeout`` seconds). ``kv_retention``: what
    a request that asks for nothing gets ("in_memory", "5m", "1h", "24h"; None: written, LRU), within
    ``kv_retention_budget`` retained bytes per tenant (default: half of ``kv_disk_size``; docs/tiers.md#retention).
    ``deterministic``: batch-invariant numerics, so a token's KV and logits never depend on chunking, batching or
    cache hits; its settings join the block identity (docs/determinism.md). ``enable_lora``: serve PEFT LoRA adapters, at most ``max_loras`` of them in
    one step, each of rank at most ``max_lora_rank``; ``lora_modules`` (name -> adapter directory) are loaded at
    start (docs/lora.md). ``chat_template``: a Jinja file or the template text to render chat prompts with instead
    of the checkpoint's, and ``chat_template_content_format`` ("auto", "string", "openai") how message content
    reaches it (vLLM's options; both join the block identity: docs/server.md#chat-template)."""

    model: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    device: str | None = None  # None: cuda when available, else cpu
    cpu_threads: int | None = None  # None: as PyTorch has it; `kvprefix serve`: engine.cpu_threads.serving_threads
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    tenant_kv_reserve: float = 0.0
    share_inflight_prefixes: bool = True
    scheduling_policy: str = "fcfs"
    max_wait_steps: int = 100
    kv_disk: str | None = None
    kv_disk_size: int | str = DEFAULT_KV_DISK_SIZE
    kv_disk_queue: int = 256
    kv_shared: str | None = None
    kv_shared_timeout: float = DEFAULT_TIMEOUT
    kv_shared_prefix: str = DEFAULT_KEY_PREFIX
    kv_retention: str | None = None
    kv_retention_budget: int | str | None = None
    deterministic: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"

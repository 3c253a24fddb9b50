"""EngineArgs: every engine setting, with vLLM's names. Pure Python, so the server's CLI can build one cheaply."""

from __future__ import annotations

from dataclasses import dataclass

from kvprefix.cache.identity import QUANTIZATION_METHODS  # noqa: F401  (the CLI's --quantization choices)


@dataclass
class EngineArgs:
    """``model`` None is the built-in default model (SmolLM2-135M-Instruct, from its GGUF file). ``dtype`` "auto" is
    bfloat16 on CUDA and on CPUs with native bfloat16 (AVX512-BF16 or AMX), else float32. The KV cache holds
    ``num_gpu_blocks`` blocks if given, else as many as fit in ``kv_cache_memory`` bytes, else (CUDA) ``gpu_memory_utilization`` of the free memory or (CPU) 1 GiB.
    ``max_model_len`` None is the model's ``max_position_embeddings``. ``tenant_kv_reserve`` > 0 isolates eviction
    between tenants: that fraction of the KV cache is shared out as each tenant's reserved room (0: one LRU for
    all; docs/security.md). ``share_inflight_prefixes``: a waiting request whose next prompt blocks a running request
    is computing waits for them (bounded) and hits, instead of computing them again. ``scheduling_policy`` "fcfs"
    admits in arrival order; "cache_aware" admits the requests with the most cached prompt tokens first, except
    that one waiting ``max_wait_steps`` steps or more goes first (docs/engine.md). ``quantization`` (CPU only) keeps the projection and lm_head weights compact:
    "int8" (per channel), "int4" (groups of 32) or "gguf" (a .gguf model's own blocks); None is dense
    (docs/model.md)."""

    model: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    device: str | None = None  # None: cuda when available, else cpu
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

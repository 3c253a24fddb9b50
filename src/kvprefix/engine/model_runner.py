"""Runs one scheduled batch through the model: builds the paged-attention metadata, runs the forward pass, and
returns the logits of the sequences whose last token was computed (those that sample a token this step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvprefix.cache import KVCacheManager
from kvprefix.engine.scheduler import SchedulerOutput
from kvprefix.model import AttentionMetadata, ModelConfig, allocate_kv_cache, kv_cache_bytes_per_block

# Default KV budget on CPU; CUDA uses a fraction of free memory instead.
CPU_KV_CACHE_BYTES = 1 << 30


def num_kv_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
) -> int:
    """How many KV blocks to allocate: ``num_blocks`` if given, else a memory budget divided by a block's bytes."""
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_blocks}")
        return num_blocks
    per_block = kv_cache_bytes_per_block(config, block_size, dtype)
    if kv_cache_memory is None:
        if device.type == "cuda":
            # vLLM's meaning: the engine may use this fraction of the whole GPU; the weights are already loaded.
            free, total = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(free - (1 - gpu_memory_utilization) * total)
        else:
            kv_cache_memory = CPU_KV_CACHE_BYTES
    blocks = kv_cache_memory // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes is less than one KV block ({per_block} bytes)")
    return blocks


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list, manager: KVCacheManager, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.manager = manager
        self.block_size = manager.block_size
        self.device = device

    @classmethod
    def create(cls, model: torch.nn.Module, num_blocks: int, manager: KVCacheManager, dtype, device) -> ModelRunner:
        kv = allocate_kv_cache(model.config, num_blocks, manager.block_size, dtype, device)
        return cls(model, kv, manager, device)

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, sample_rows: list[int], score_rows: Sequence[int] = ()
    ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """Computes every scheduled token; returns float32 logits [len(sample_rows), vocab], and for each of
        ``score_rows`` (prompt logprobs) the hidden states of its positions whose next token is a prompt token."""
        chunks, token_ids = [], []
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            chunks.append((start, s.num_new_tokens, self.manager.get_block_ids(req.request_id)))
            token_ids += req.token_ids[start : start + s.num_new_tokens]
        dev = self.device
        meta, positions = AttentionMetadata.for_chunks(chunks, self.block_size, dev)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        scored = {}
        if score_rows:
            offsets = [0]
            for s in sched.scheduled:
                offsets.append(offsets[-1] + s.num_new_tokens)
            for i in score_rows:
                req = sched.scheduled[i].request
                n = min(sched.scheduled[i].num_new_tokens, req.num_prompt_tokens - 1 - req.num_computed_tokens)
                if n > 0:
                    scored[i] = hidden[offsets[i] : offsets[i] + n]
        if not sample_rows:
            return None, scored
        # Only rows that sample need logits: the vocabulary projection is the costliest matmul of a decode.
        rows = meta.logits_indices[torch.tensor(sample_rows, dtype=torch.long, device=dev)]
        return self.model.compute_logits(hidden[rows]).float(), scored

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

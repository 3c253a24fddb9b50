"""Runs one scheduled batch through the model: builds the paged-attention metadata, runs the forward pass, and
returns the logits of the sequences whose last token was computed (those that sample a token this step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvprefix.cache import KVCacheManager
from kvprefix.engine.scheduler import SchedulerOutput
from kvprefix.model import AttentionMetadata, ModelConfig, allocate_kv_cache, kv_cache_bytes_per_block
from kvprefix.model.lora import LoraLayers

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
    """``lora_layers`` (a ``model.lora.LoraLayers``, with ``enable_lora``): each step's sequences are grouped by
    adapter so that an adapter's rows are one contiguous range of the flattened batch."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, manager: KVCacheManager, device: torch.device,
                 lora_layers: LoraLayers | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.manager = manager
        self.block_size = manager.block_size
        self.device = device
        self.lora_layers = lora_layers

    @classmethod
    def create(cls, model: torch.nn.Module, num_blocks: int, manager: KVCacheManager, dtype, device,
               lora_layers: LoraLayers | None = None) -> ModelRunner:
        kv = allocate_kv_cache(model.config, num_blocks, manager.block_size, dtype, device)
        return cls(model, kv, manager, device, lora_layers)

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, sample_rows: list[int], score_rows: Sequence[int] = ()
    ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """Computes every scheduled token; returns float32 logits [len(sample_rows), vocab], and for each of
        ``score_rows`` (prompt logprobs) the hidden states of its positions whose next token is a prompt token."""
        order = self._batch_order(sched)
        chunks, token_ids, starts, segments = [], [], [], []
        for i in order:
            s = sched.scheduled[i]
            req = s.request
            start = req.num_computed_tokens
            chunks.append((start, s.num_new_tokens, self.manager.get_block_ids(req.request_id)))
            starts.append(len(token_ids))
            if req.lora is not None:
                if segments and segments[-1][2] is req.lora:
                    segments[-1][1] += s.num_new_tokens
                else:
                    segments.append([len(token_ids), len(token_ids) + s.num_new_tokens, req.lora])
            token_ids += req.token_ids[start : start + s.num_new_tokens]
        position = [0] * len(order)  # of each scheduled request in the batch
        for pos, i in enumerate(order):
            position[i] = pos
        dev = self.device
        meta, positions = AttentionMetadata.for_chunks(chunks, self.block_size, dev)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        if self.lora_layers is not None:
            self.lora_layers.set_batch([tuple(seg) for seg in segments])
        try:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        finally:
            if self.lora_layers is not None:
                self.lora_layers.set_batch([])
        scored = {}
        for i in score_rows:
            req = sched.scheduled[i].request
            n = min(sched.scheduled[i].num_new_tokens, req.num_prompt_tokens - 1 - req.num_computed_tokens)
            if n > 0:
                first = starts[position[i]]
                scored[i] = hidden[first : first + n]
        if not sample_rows:
            return None, scored
        # Only rows that sample need logits: the vocabulary projection is the costliest matmul of a decode.
        rows = meta.logits_indices[torch.tensor([position[i] for i in sample_rows], dtype=torch.long, device=dev)]
        return self.model.compute_logits(hidden[rows]).float(), scored

    def _batch_order(self, sched: SchedulerOutput) -> list[int]:
        """The scheduled requests in batch order: as scheduled, or with LoRA, the base model's first and then each
        adapter's together (stable), so that each adapter's rows are one range."""
        indices = list(range(len(sched.scheduled)))
        if self.lora_layers is None:
            return indices
        rank: dict[int, int] = {}
        for s in sched.scheduled:
            if s.request.lora is not None:
                rank.setdefault(id(s.request.lora), len(rank) + 1)
        if not rank:
            return indices
        return sorted(indices, key=lambda i: rank.get(id(sched.scheduled[i].request.lora), 0))

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write for forked beams: each (source, destination) block pair's K and V, in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for layer in self.kv_caches:
            layer.kv.index_copy_(0, dst, layer.kv.index_select(0, src))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

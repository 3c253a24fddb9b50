"""Paged attention over a block-structured KV cache (portable PyTorch path, CPU and CUDA).

The cache holds, per layer, K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's
context lives in the blocks of its block table; token j of the sequence is at slot
block_table[j // block_size] * block_size + j % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvprefix.model.config import ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionMetadata:
    """One flattened batch of sequences (prefill chunks and decodes mixed); see docs/architecture.md."""

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset for each new token
    query_start_loc: torch.Tensor  # int64 [S+1]: token range of each sequence in the batch
    seq_lens: list[int]  # context length of each sequence, including this step's new tokens
    block_tables: torch.Tensor  # int64 [S, max_blocks], padded with 0
    logits_indices: torch.Tensor  # int64 [S]: each sequence's last new token
    # Derived once per forward and shared by all layers (built on first use).
    _plan: _BatchPlan | None = field(default=None, init=False, repr=False)

    def plan(self, block_size: int) -> _BatchPlan:
        if self._plan is None:
            self._plan = _BatchPlan.build(self, block_size)
        return self._plan


@dataclass
class _Prefill:
    start: int  # first token of the sequence in the flattened batch
    end: int
    seq_len: int
    block_ids: torch.Tensor  # the blocks that hold its seq_len positions


@dataclass
class _BatchPlan:
    prefills: list[_Prefill]
    # All single-token sequences are attended in one batched call over their blocks, padded to the longest.
    decode_tokens: torch.Tensor | None  # int64 [D]: their token indices in the flattened batch
    decode_blocks: torch.Tensor | None  # int64 [D, max_blocks]
    decode_seq_lens: torch.Tensor | None  # int64 [D]
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> _BatchPlan:
        starts = meta.query_start_loc.tolist()
        prefills, decodes = [], []
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = starts[i], starts[i + 1]
            if end - start == 1:
                decodes.append(i)
            else:
                num_blocks = -(-seq_len // block_size)
                prefills.append(_Prefill(start, end, seq_len, meta.block_tables[i, :num_blocks]))
        if not decodes:
            return cls(prefills, None, None, None)
        device = meta.block_tables.device
        lens = [meta.seq_lens[i] for i in decodes]
        num_blocks = -(-max(lens) // block_size)
        rows = torch.tensor(decodes, device=device)
        return cls(
            prefills,
            decode_tokens=torch.tensor([starts[i] for i in decodes], device=device),
            decode_blocks=meta.block_tables[rows, :num_blocks],
            decode_seq_lens=torch.tensor(lens, device=device),
        )

    def decode_mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """bool [D, 1, 1, keys]: each decode sees its own positions only (and, with a window, recent ones)."""
        if window not in self._decode_masks:
            keys = torch.arange(self.decode_blocks.shape[1] * block_size, device=self.decode_blocks.device)
            lens = self.decode_seq_lens[:, None]
            mask = keys[None, :] < lens
            if window is not None:
                mask &= keys[None, :] > lens - 1 - window
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> KVCache:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], zero-filled.

    Zeros, not empty: padded positions of a batched decode are masked, but NaN garbage there would still leak
    through the softmax-weighted sum.
    """
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V), to size the cache from a memory budget."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, q_heads, head_dim]; k, v: [T, kv_heads, head_dim] for the new tokens. Returns [T, q_heads, head_dim].

    Writes the new K/V into the cache by slot first, so each sequence then reads its whole context from its blocks.
    """
    k_cache, v_cache = kv_cache
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = k
    v_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = v
    plan = meta.plan(block_size)
    out = torch.empty_like(q)
    for p in plan.prefills:
        out[p.start : p.end] = _prefill(q, k, v, k_cache, v_cache, p, scale, window)
    if plan.decode_tokens is not None:
        out[plan.decode_tokens] = _decode(q, k_cache, v_cache, plan, scale, window)
    return out


def _prefill(q, k, v, k_cache, v_cache, p: _Prefill, scale: float, window: int | None) -> torch.Tensor:
    num_new = p.end - p.start
    query = q[p.start : p.end].transpose(0, 1)  # [heads, new, dim]
    if num_new == p.seq_len:
        # Nothing cached before this chunk: its own fresh K/V are the whole context (same values as the cache).
        keys, values = k[p.start : p.end], v[p.start : p.end]
    else:
        keys = k_cache[p.block_ids].flatten(0, 1)[: p.seq_len]
        values = v_cache[p.block_ids].flatten(0, 1)[: p.seq_len]
    # A leading batch dim of 1: 4-D inputs take PyTorch's fused CPU attention kernel, 3-D ones the much slower
    # math fallback (6x on a 1k-token prefill).
    query, keys, values = query[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if num_new == p.seq_len and window is None:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # is_causal aligns the top-left corner, which is wrong once a cached prefix precedes the chunk.
        q_pos = torch.arange(p.seq_len - num_new, p.seq_len, device=q.device)[:, None]
        k_pos = torch.arange(p.seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _decode(q, k_cache, v_cache, plan: _BatchPlan, scale: float, window: int | None) -> torch.Tensor:
    block_size = k_cache.shape[1]
    query = q[plan.decode_tokens][:, :, None, :]  # [D, heads, 1, dim]
    keys = k_cache[plan.decode_blocks].flatten(1, 2).transpose(1, 2)  # [D, kv_heads, keys, dim]
    values = v_cache[plan.decode_blocks].flatten(1, 2).transpose(1, 2)
    mask = plan.decode_mask(window, block_size)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]

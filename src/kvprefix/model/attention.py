"""Paged attention over a block-structured KV cache (portable PyTorch path, CPU and CUDA).

The cache holds, per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim], as the two halves of
one [num_blocks, block_size, 2 * num_kv_heads, head_dim] tensor (``LayerKV``): one op writes a step's K and V, one
gathers them. A sequence's context lives in the blocks of its block table; token j of the sequence is at slot
block_table[j // block_size] * block_size + j % block_size.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvprefix.cache import cdiv
from kvprefix.model.batch_invariant import invariant_attention
from kvprefix.model.config import ModelConfig


class LayerKV(tuple):
    """One layer's (K, V), each [num_blocks, block_size, kv_heads, head_dim]: views of ``kv``, which holds K then
    V heads per slot (the qkv projection's order), so one ``index_copy_`` writes a step's K and V."""

    kv: torch.Tensor

    def __new__(cls, kv: torch.Tensor) -> LayerKV:
        heads = kv.shape[2] // 2
        pair = super().__new__(cls, (kv[:, :, :heads], kv[:, :, heads:]))
        pair.kv = kv
        return pair


KVCache = list[LayerKV]

# From this many new tokens a CPU chunk after earlier context attends in two unmasked calls (``_after_context``);
# below it one masked call costs less than two calls and their merge (docs/model.md#attention).
SPLIT_MIN_NEW = 256

_scratch = threading.local()  # gather buffers, per thread (each engine runs its forwards on one thread)


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

    @classmethod
    def for_chunks(
        cls, chunks: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device | str = "cpu"
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and token positions [T] for a batch of chunks, each (tokens already in the cache, new tokens,
        the sequence's block ids)."""
        position_chunks, slot_chunks, tables, seq_lens, starts = [], [], [], [], [0]
        for num_computed, num_new, block_ids in chunks:
            table = np.asarray(block_ids, dtype=np.int64)
            positions = np.arange(num_computed, num_computed + num_new, dtype=np.int64)
            position_chunks.append(positions)
            slot_chunks.append(table[positions // block_size] * block_size + positions % block_size)
            tables.append(table)
            seq_lens.append(num_computed + num_new)
            starts.append(starts[-1] + num_new)
        block_tables = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        query_start_loc = torch.tensor(starts, dtype=torch.long)
        meta = cls(
            slot_mapping=torch.from_numpy(np.concatenate(slot_chunks)).to(device),
            query_start_loc=query_start_loc.to(device),
            seq_lens=seq_lens,
            block_tables=torch.from_numpy(block_tables).to(device),
            logits_indices=(query_start_loc[1:] - 1).to(device),
        )
        return meta, torch.from_numpy(np.concatenate(position_chunks)).to(device)

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
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive [group * new, seq_len] causal mask for the GQA-folded query rows (see _prefill), built once per
        step in the query dtype so no layer converts a bool mask."""
        if window not in self._masks:
            num_new = self.end - self.start
            q_pos = torch.arange(self.seq_len - num_new, self.seq_len, device=self.block_ids.device)[:, None]
            k_pos = torch.arange(self.seq_len, device=self.block_ids.device)[None, :]
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -torch.inf)
            self._masks[window] = mask.repeat(group, 1)
        return self._masks[window]


@dataclass
class _BatchPlan:
    prefills: list[_Prefill]
    # All single-token sequences are attended in one batched call over their blocks, padded to the longest.
    decode_tokens: torch.Tensor | None  # int64 [D]: their token indices in the flattened batch
    decode_blocks: torch.Tensor | None  # int64 [D * max_blocks]: their block tables, flattened for index_select
    decode_seq_lens: torch.Tensor | None  # int64 [D]
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _decode_context: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> _BatchPlan:
        starts = meta.query_start_loc.tolist()
        prefills, decodes = [], []
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = starts[i], starts[i + 1]
            if end - start == 1:
                decodes.append(i)
            else:
                num_blocks = cdiv(seq_len, block_size)
                prefills.append(_Prefill(start, end, seq_len, meta.block_tables[i, :num_blocks]))
        if not decodes:
            return cls(prefills, None, None, None)
        device = meta.block_tables.device
        lens = [meta.seq_lens[i] for i in decodes]
        num_blocks = cdiv(max(lens), block_size)
        rows = torch.tensor(decodes, device=device)
        return cls(
            prefills,
            decode_tokens=torch.tensor([starts[i] for i in decodes], device=device),
            decode_blocks=meta.block_tables[rows, :num_blocks].flatten(),
            decode_seq_lens=torch.tensor(lens, device=device),
        )

    def decode_mask(self, window: int | None, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive [D, 1, 1, keys]: each decode sees its own positions only (and, with a window, recent ones)."""
        if window not in self._decode_masks:
            keys = torch.arange(num_keys, device=self.decode_blocks.device)
            lens = self.decode_seq_lens[:, None]
            visible = keys[None, :] < lens
            if window is not None:
                visible &= keys[None, :] > lens - 1 - window
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -torch.inf)
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]

    def decode_context(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gather target, keys, values [D, kv_heads, max_blocks * block_size, head_dim]): views of one buffer,
        built once per step, that every layer gathers its decodes' blocks into."""
        if cache.dtype not in self._decode_context:
            num, (both_heads, head_dim) = self.decode_tokens.numel(), cache.shape[2:]
            target = _gather_target(cache, self.decode_blocks.numel())
            context = target.view(num, -1, both_heads, head_dim).transpose(1, 2)
            heads = both_heads // 2
            self._decode_context[cache.dtype] = target, context[:, :heads], context[:, heads:]
        return self._decode_context[cache.dtype]


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> KVCache:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim] (``LayerKV``), zero-filled:
    padded decode positions are masked, but NaN garbage there would still leak through the weighted sum."""
    shape = (num_blocks, block_size, 2 * config.num_key_value_heads, config.head_dim)
    return [LayerKV(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(config.num_hidden_layers)]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V), to size the cache from a memory budget."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """q: [T, q_heads, head_dim]; kv: [T, 2 * kv_heads, head_dim] (K heads then V heads). Returns [T, q_heads,
    head_dim]. Writes the new K/V into the cache first, so each sequence reads its whole context from its blocks.
    ``batch_invariant``: every query through ``invariant_attention`` (deterministic mode)."""
    cache = kv_cache.kv
    block_size, kv_heads, head_dim = cache.shape[1], cache.shape[2] // 2, cache.shape[3]
    # index_copy_ copies whole rows (index_put_ goes element by element); kv may be a strided view.
    cache.view(-1, 2 * kv_heads, head_dim).index_copy_(0, meta.slot_mapping, kv)
    if batch_invariant:
        return invariant_attention(q, cache, meta, block_size, scale, window)
    plan = meta.plan(block_size)
    # A batch of one prefill, or of decodes only (one token each, in batch order), needs no scatter into `out`.
    if not plan.prefills:
        return _decode(q, cache, plan, scale, window)  # q: the decodes' queries, in order
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    if len(plan.prefills) == 1 and plan.decode_tokens is None:
        return _prefill(q, k, v, cache, plan.prefills[0], scale, window)
    out = torch.empty_like(q)
    for p in plan.prefills:
        out[p.start : p.end] = _prefill(q, k, v, cache, p, scale, window)
    if plan.decode_tokens is not None:
        out[plan.decode_tokens] = _decode(q[plan.decode_tokens], cache, plan, scale, window)
    return out


def _prefill(q, k, v, cache, p: _Prefill, scale: float, window: int | None) -> torch.Tensor:
    num_new = p.end - p.start
    query = q[p.start : p.end]  # [new, heads, dim]
    if num_new == p.seq_len:
        # Nothing cached before this chunk: its own fresh K/V are the whole context (same values as the cache).
        keys, values = k[p.start : p.end], v[p.start : p.end]
    else:
        context = _gather(cache, p.block_ids).flatten(0, 1)[: p.seq_len]
        keys, values = context[:, : k.shape[1]], context[:, k.shape[1] :]
    if window is None and num_new == p.seq_len:
        # 4-D inputs take PyTorch's fused CPU attention kernel; 3-D ones the much slower math fallback.
        query, keys, values = (x.transpose(0, 1)[None] for x in (query, keys, values))
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    if window is None and query.device.type == "cpu" and num_new >= SPLIT_MIN_NEW:
        return _after_context(query, keys, values, scale)
    # is_causal aligns the top-left corner, which is wrong once a cached prefix precedes the chunk: explicit mask.
    _, kv_heads, head_dim = keys.shape
    mask = p.mask(window, q.shape[1] // kv_heads, q.dtype)
    out = F.scaled_dot_product_attention(_fold_heads(query, kv_heads), *_by_kv_head(keys, values), attn_mask=mask,
                                         scale=scale)
    return out.view(kv_heads, -1, num_new, head_dim).permute(2, 0, 1, 3).reshape(num_new, -1, head_dim)


def _fold_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """GQA folded into the query length: [new, heads, dim] -> [kv_heads, 1, group * new, dim], each KV head's
    ``group`` query heads one after another, so K/V are not repeated per query head (bit-identical)."""
    num_new, heads, head_dim = query.shape
    query = query.view(num_new, kv_heads, heads // kv_heads, head_dim).permute(1, 2, 0, 3)
    return query.reshape(kv_heads, 1, -1, head_dim)


def _by_kv_head(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[seq, kv_heads, dim] -> [kv_heads, 1, seq, dim], the layout ``_fold_heads``'s rows attend over."""
    return keys.transpose(0, 1)[:, None], values.transpose(0, 1)[:, None]


def _after_context(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """A CPU prefill chunk after earlier context: its queries attend to the context unmasked (GQA folded) and to
    their own keys causally, two calls of PyTorch's flash kernel merged by their log-sum-exps. One call with an
    explicit mask is slower: the kernel then reads the mask and computes every masked block."""
    num_new, heads, head_dim = query.shape
    kv_heads, group = keys.shape[1], heads // keys.shape[1]
    context = keys.shape[0] - num_new
    seen, seen_lse = _flash_cpu(_fold_heads(query, kv_heads).transpose(0, 1), *(
        x.transpose(0, 1) for x in _by_kv_head(keys[:context], values[:context])), False, scale)
    own, own_lse = _flash_cpu(query.transpose(0, 1)[None], *(
        x[context:].transpose(0, 1).repeat_interleave(group, 0)[None] for x in (keys, values)), True, scale)
    # out = own * (1 - w) + seen * w, w = the share of the softmax mass on the context: sigmoid of the lse gap.
    weight = torch.sigmoid(seen_lse.reshape(heads, num_new, 1) - own_lse.reshape(heads, num_new, 1))
    out = torch.lerp(own.reshape(heads, num_new, head_dim).float(), seen.reshape(heads, num_new, head_dim).float(),
                     weight)
    return out.transpose(0, 1).to(query.dtype)


def _flash_cpu(query, keys, values, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention on [1, heads, len, dim] inputs: (output, natural log-sum-exp per query row)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, causal,
                                                                          scale=scale)
    return out, lse


def _decode(q, cache, plan: _BatchPlan, scale: float, window: int | None) -> torch.Tensor:
    """q: [D, q_heads, head_dim], the decodes' queries in plan order."""
    target, keys, values = plan.decode_context(cache)
    torch.index_select(cache, 0, plan.decode_blocks, out=target)
    num, kv_heads, num_keys, head_dim = keys.shape
    # GQA folded: each KV head's query heads are its query rows, [D, kv_heads, group, dim], so K/V are not repeated.
    query = q.view(num, kv_heads, -1, head_dim)
    mask = plan.decode_mask(window, num_keys, q.dtype)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out.view(num, -1, head_dim)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids], valid until the next gather (index_select copies whole blocks; indexing goes by element)."""
    return torch.index_select(cache, 0, block_ids, out=_gather_target(cache, block_ids.numel()))


def _gather_target(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """An uninitialized tensor to gather ``num_blocks`` blocks of ``cache`` into.

    On CPU a view of a per-thread buffer reused across layers and steps: a fresh allocation above glibc's mmap
    threshold is page-faulted in on every use, costing more than the copy. CUDA's caching allocator reuses memory.
    """
    shape = (num_blocks, *cache.shape[1:])
    if cache.device.type != "cpu":
        return torch.empty(shape, dtype=cache.dtype, device=cache.device)
    size = math.prod(shape)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(cache.dtype)
    if buf is None or buf.numel() < size:
        buf = buffers[cache.dtype] = torch.empty(size, dtype=cache.dtype)
    return buf[:size].view(shape)

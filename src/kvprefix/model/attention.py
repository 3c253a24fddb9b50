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
from kvprefix.model import native_attention, native_prefill
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

# Decodes whose block tables open with the same blocks (a cached prefix they share) attend to those blocks once, all
# their queries in one call, and to the rest of their contexts apart: cascade attention (as vLLM and FlashInfer name
# it). CPU, no window, from this many shared tokens.
CASCADE_MIN_TOKENS = 256

# Without a window, a bfloat16 CPU prefill chunk attends on the native kernel where this CPU has AVX512-BF16
# (``native_prefill``: 0.3-0.7x the time of every way below, from 16 tokens up). The ways below
# serve the others: float32, CUDA, windows, CPUs without the kernel.
# A bfloat16 CPU prefill chunk of at least TILED_MIN_NEW tokens that sees at least TILED_MIN_KEYS positions attends
# in tiles of TILE_TOKENS queries with plain matmuls (``_tiled``): there it took 0.66-0.83x the time of PyTorch's
# flash kernel; over fewer positions, and in float32 (1.2-1.3x), the flash kernel is faster
# (docs/model.md#paged-attention). SHIFT_KEYS: the keys a tile samples for the shift of its scores; TILE_SCORES: the
# most scores one call computes for all KV heads at once (6 MB in bfloat16), past it one head at a time (0.9x the
# time after 4,064 positions, where a tile's scores for 3 heads would no longer stay in cache).
TILED_MIN_NEW = 16
TILED_MIN_KEYS = 1024
TILE_TOKENS = 128
SHIFT_KEYS = 256
TILE_SCORES = 3_000_000

_scratch = threading.local()  # gather and score buffers, per thread (each engine runs its forwards on one thread)


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
class _Decodes:
    """Single-token sequences attended in one batched call over their blocks (from some block on), padded to the
    longest."""

    blocks: torch.Tensor  # int64 [D * max_blocks]: their block tables, flattened for index_select
    seq_lens: torch.Tensor  # int64 [D]: the positions those blocks hold for each
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _context: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def mask(self, window: int | None, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive [D, 1, 1, keys]: each decode sees its own positions only (and, with a window, recent ones)."""
        if window not in self._masks:
            keys = torch.arange(num_keys, device=self.blocks.device)
            lens = self.seq_lens[:, None]
            visible = keys[None, :] < lens
            if window is not None:
                visible &= keys[None, :] > lens - 1 - window
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -torch.inf)
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]

    def context(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gather target, keys, values [D, kv_heads, max_blocks * block_size, head_dim]): views of one buffer,
        built once per step, that every layer gathers the blocks into."""
        if cache.dtype not in self._context:
            num, (both_heads, head_dim) = self.seq_lens.numel(), cache.shape[2:]
            target = _gather_target(cache, self.blocks.numel())
            context = target.view(num, -1, both_heads, head_dim).transpose(1, 2)
            heads = both_heads // 2
            self._context[cache.dtype] = target, context[:, :heads], context[:, heads:]
        return self._context[cache.dtype]

    def gather(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of this layer's ``cache`` at the blocks, gathered into the step's ``context`` buffer."""
        target, keys, values = self.context(cache)
        torch.index_select(cache, 0, self.blocks, out=target)
        return keys, values


@dataclass
class _SharedDecodes:
    """Decodes that all open with ``prefix_blocks``: attended there in one call, and over ``rest`` apart."""

    prefix_blocks: torch.Tensor  # int64 [shared]
    rest: _Decodes


@dataclass
class _BatchPlan:
    prefills: list[_Prefill]
    decode_tokens: torch.Tensor | None  # int64 [D]: the decodes' token indices in the flattened batch
    decodes: _Decodes | None
    shared: _SharedDecodes | None = None

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
            return cls(prefills, None, None)
        device = meta.block_tables.device
        lens = [meta.seq_lens[i] for i in decodes]
        table = meta.block_tables[torch.tensor(decodes, device=device), : cdiv(max(lens), block_size)]
        seq_lens = torch.tensor(lens, device=device)
        # CPU only: the cascade's kernel is PyTorch's CPU flash attention (and on CUDA the count would sync)
        shared = _common_blocks(table, min(lens), block_size) if device.type == "cpu" else 0
        cascade = shared * block_size >= CASCADE_MIN_TOKENS
        rest = _Decodes(table[:, shared:].flatten(), seq_lens - shared * block_size) if cascade else None
        return cls(prefills, decode_tokens=torch.tensor([starts[i] for i in decodes], device=device),
                   decodes=_Decodes(table.flatten(), seq_lens),
                   shared=_SharedDecodes(table[0, :shared], rest) if cascade else None)


def _common_blocks(table: torch.Tensor, min_len: int, block_size: int) -> int:
    """How many leading blocks every row of ``table`` (two rows or more) has in common, each row keeping at least
    its last position after them."""
    if table.shape[0] < 2:
        return 0
    same = (table == table[:1]).all(0).int()
    return min(int(same.cumprod(0).sum()), (min_len - 1) // block_size)


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
    if len(plan.prefills) == 1 and plan.decodes is None:
        return _prefill(q, k, v, cache, plan.prefills[0], scale, window)
    out = torch.empty_like(q)
    for p in plan.prefills:
        out[p.start : p.end] = _prefill(q, k, v, cache, p, scale, window)
    if plan.decodes is not None:
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
    if window is None and native_prefill.supports(query):
        scratch = _buffer("packed", query.dtype, native_prefill.scratch_size(p.seq_len, *keys.shape[1:]))
        return native_prefill.prefill_attention(query, keys, values, scale, scratch)
    if (window is None and query.dtype == torch.bfloat16 and query.device.type == "cpu"
            and num_new >= TILED_MIN_NEW and p.seq_len >= TILED_MIN_KEYS):
        return _tiled(query, keys, values, scale)
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
    own = own.reshape(heads, num_new, head_dim)
    seen = seen.reshape(heads, num_new, head_dim)
    out = _merge(own, own_lse.reshape(heads, num_new), seen, seen_lse.reshape(heads, num_new))
    return out.transpose(0, 1)


def _tiled(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a CPU prefill chunk (the last ``new`` of the keys' positions) in tiles of
    ``TILE_TOKENS`` queries, GQA folded into the rows: a tile's scores against the keys up to its last query in one
    matmul, the causal mask on the tile's own keys only, the softmax over whole rows in place, one matmul with the
    values. Keys after a tile are never computed, and its scores stay in cache.

    The scores come out of the matmul in the model's dtype. So that rounding them to bfloat16 costs the large
    weights no precision, each row is shifted inside the matmul (an extra column: -shift on the query, 1 on every
    key, summed in float32) by its largest score over the tile's own keys it sees and the first ``SHIFT_KEYS`` keys
    (and by no less than 0): the softmax is the same for any shift, and its peak scores land near 0, where
    bfloat16 is fine."""
    num_new, heads, head_dim = query.shape
    kv_heads, seq_len = keys.shape[1], keys.shape[0]
    group, context = heads // kv_heads, seq_len - num_new
    width = head_dim + 2  # the shift's column, and one of zeros to keep the width even (bfloat16 goes in pairs)
    # GQA folded token by token (a tile's rows are its tokens' query heads): [kv_heads, new * group, width]
    rows = query.new_zeros(kv_heads, num_new * group, width)
    rows[..., :head_dim] = query.view(num_new, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads, -1,
                                                                                                   head_dim)
    extended = keys.new_zeros(kv_heads, seq_len, width)  # [kv_heads, seq, width]: the keys, then 1
    extended[..., :head_dim] = keys.transpose(0, 1)
    extended[..., head_dim] = 1
    values = values.transpose(0, 1).contiguous()
    out = torch.empty(kv_heads, num_new * group, head_dim, dtype=values.dtype)
    tile = min(TILE_TOKENS, num_new)
    later = torch.arange(tile)[None, :] > (torch.arange(tile * group) // group)[:, None]  # a tile's future keys
    for start in range(0, num_new, tile):
        end = min(start + tile, num_new)
        top, bottom, seen = start * group, end * group, context + end
        tile_rows = rows[:, top:bottom]
        own = torch.bmm(tile_rows[..., :head_dim], extended[:, context + start : seen, :head_dim].transpose(1, 2))
        shift = own.masked_fill_(later[: bottom - top, : end - start], -torch.inf).amax(-1).clamp_min_(0)
        if context + start:
            sample = extended[:, : min(SHIFT_KEYS, context + start), :head_dim]
            shift = torch.maximum(shift, torch.bmm(tile_rows[..., :head_dim], sample.transpose(1, 2)).amax(-1))
        tile_rows[..., head_dim] = -shift
        # All KV heads in one call while their scores fit TILE_SCORES; one head at a time past it.
        step = kv_heads if kv_heads * (bottom - top) * seen <= TILE_SCORES else 1
        for head in range(0, kv_heads, step):
            part = slice(head, head + step)
            scores = _buffer("scores", query.dtype, step * (bottom - top) * seen).view(step, -1, seen)
            torch.baddbmm(scores, tile_rows[part], extended[part, :seen].transpose(1, 2), beta=0, alpha=scale,
                          out=scores)
            scores[:, :, context + start :].masked_fill_(later[: bottom - top, : end - start], -torch.inf)
            torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # in place, row by row
            torch.bmm(scores, values[part, :seen], out=out[part, top:bottom])
    return out.view(kv_heads, num_new, group, head_dim).permute(1, 0, 2, 3).reshape(num_new, heads, head_dim)


def _merge(own: torch.Tensor, own_lse: torch.Tensor, seen: torch.Tensor, seen_lse: torch.Tensor) -> torch.Tensor:
    """Attention of the same queries over two disjoint sets of keys, combined: own * (1 - w) + seen * w, w the
    share of the softmax mass on ``seen``'s keys, sigmoid of the log-sum-exp gap (in float32; own's dtype out)."""
    weight = torch.sigmoid(seen_lse - own_lse)[..., None]
    return torch.lerp(own.float(), seen.float(), weight).to(own.dtype)


def _flash_cpu(query, keys, values, causal: bool, scale: float,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention on [batch, heads, len, dim] inputs: (output, natural log-sum-exp per query
    row)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, causal,
                                                                          attn_mask=mask, scale=scale)
    return out, lse


def _decode(q, cache, plan: _BatchPlan, scale: float, window: int | None) -> torch.Tensor:
    """q: [D, q_heads, head_dim], the decodes' queries in plan order."""
    if window is None and plan.shared is not None:
        return _decode_shared(q, cache, plan.shared, scale)
    if window is None and native_attention.supports(q, cache):
        decodes = plan.decodes
        table = decodes.blocks.view(decodes.seq_lens.numel(), -1)
        return native_attention.decode_attention(q, cache, table, decodes.seq_lens, scale)
    keys, values = plan.decodes.gather(cache)
    num, kv_heads, num_keys, head_dim = keys.shape
    # GQA folded: each KV head's query heads are its query rows, [D, kv_heads, group, dim], so K/V are not repeated.
    query = q.view(num, kv_heads, -1, head_dim)
    mask = plan.decodes.mask(window, num_keys, q.dtype)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out.view(num, -1, head_dim)


def _decode_shared(q, cache, shared: _SharedDecodes, scale: float) -> torch.Tensor:
    """Decodes that share their first blocks: every query of the batch attends to those blocks in one unmasked call
    (GQA and the batch folded into the query rows), each to the rest of its own context in the batched masked
    call; the two merged by log-sum-exp. The shared blocks are read once instead of once per decode."""
    num, heads, head_dim = q.shape
    prefix = _gather(cache, shared.prefix_blocks).flatten(0, 1)  # [shared tokens, 2 * kv_heads, dim]
    kv_heads = prefix.shape[1] // 2
    group = heads // kv_heads
    folded = q.view(num, kv_heads, group, head_dim).transpose(0, 1).reshape(1, kv_heads, num * group, head_dim)
    seen, seen_lse = _flash_cpu(folded, prefix[:, :kv_heads].transpose(0, 1)[None],
                                prefix[:, kv_heads:].transpose(0, 1)[None], False, scale)
    keys, values = shared.rest.gather(cache)  # into the same scratch buffer as `prefix`: after `seen` is out
    own, own_lse = _flash_cpu(q.view(num, kv_heads, group, head_dim), keys, values, False, scale,
                              shared.rest.mask(None, keys.shape[2], q.dtype))
    seen = seen.reshape(kv_heads, num, group, head_dim).transpose(0, 1)
    seen_lse = seen_lse.reshape(kv_heads, num, group).transpose(0, 1)
    return _merge(own, own_lse, seen, seen_lse).reshape(num, heads, head_dim)


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
    return _buffer("gather", cache.dtype, math.prod(shape)).view(shape)


def _buffer(name: str, dtype: torch.dtype, size: int) -> torch.Tensor:
    """A flat uninitialized CPU tensor of ``size`` elements, a view of this thread's buffer ``name``, which grows
    as needed and is reused across layers and steps."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get((name, dtype))
    if buf is None or buf.numel() < size:
        buf = buffers[name, dtype] = torch.empty(size, dtype=dtype)
    return buf[:size]

"""Batch-invariant numerics (``deterministic`` mode, docs/determinism.md): a token's K, V and logits bitwise
independent of how the step was cut (chunk boundaries, other requests in the batch, cached or recomputed prefix).

A CPU matmul's result for one row depends on the number of rows (MKL and oneDNN pick kernels and blockings by
shape), and attention's depends on how keys are split (fused prefill kernel, masked chunk path, batched decode).
Here every reduction runs at a fixed shape in a fixed order: projections in tiles of ``ROW_TILE`` rows
(``RowTiled``), attention over the cache in tiles of ``QUERY_TILE`` tokens by ``KEY_TILE`` keys counted from
position 0 (``invariant_attention``). Keys past a query's position are masked to exact zeros, so a query's sums do
not change with the tile's length. Elementwise ops (RoPE, SiLU, residuals) and per-row norms need nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from kvprefix.cache import cdiv

ROW_TILE = 32  # rows per projection matmul
QUERY_TILE = 4  # tokens per attention tile (times the GQA group: rows per KV head)
KEY_TILE = 64  # keys per partial sum of the attention's value product
_QUERY_GROUP = 32  # prefill tiles attended together (one batched matmul over keys up to the group's last position)


class RowTiled(nn.Module):
    """Runs ``inner`` (any per-row projection: ``nn.Linear``, compact weights) on tiles of exactly ``ROW_TILE``
    rows, the last one padded with zeros, so each row's output does not depend on how many rows came with it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        num = rows.shape[0]
        padded = cdiv(num, ROW_TILE) * ROW_TILE
        if padded != num:
            rows = torch.cat([rows, rows.new_zeros(padded - num, rows.shape[1])])
        out = torch.cat([self.inner(rows[i : i + ROW_TILE]) for i in range(0, padded, ROW_TILE)])
        return out[:num].view(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Wraps every projection of a loaded (possibly compact-weight) model in ``RowTiled`` and switches its
    attention layers to ``invariant_attention``; returns the model."""
    from kvprefix.model.llama import Attention  # llama imports attention, which imports this module

    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.batch_invariant = True
        for name, child in list(module.named_children()):
            if not isinstance(child, RowTiled) and hasattr(child, "in_features") and hasattr(child, "out_features"):
                setattr(module, name, RowTiled(child))
    return model


def numerics_fingerprint(device: torch.device | str) -> str:
    """What must match for deterministic mode's bytes to be reproduced elsewhere: the kernels (torch, hence its
    MKL and oneDNN), the instruction set they dispatch to, the thread count, the device type and these tiles."""
    device = torch.device(device)
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.cuda.get_device_name(device)
    tiles = f"{ROW_TILE}x{QUERY_TILE}x{KEY_TILE}"
    return f"invariant:torch{torch.__version__}:{device.type}:{isa}:threads{torch.get_num_threads()}:tiles{tiles}"


def invariant_attention(q, cache, meta, block_size: int, scale: float, window: int | None) -> torch.Tensor:
    """q [T, q_heads, head_dim] -> [T, q_heads, head_dim]; every sequence's K/V read from its blocks in ``cache``
    ([num_blocks, block_size, 2 * kv_heads, head_dim], this step's K/V already written)."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = cache.shape[2] // 2
    out = torch.empty(num_tokens, q_heads, head_dim, dtype=torch.float32, device=q.device)
    starts = meta.query_start_loc.tolist()
    decodes = [i for i in range(len(meta.seq_lens)) if starts[i + 1] - starts[i] == 1]
    if decodes:  # one tile each, batched: keys up to the longest, padded
        tokens = [starts[i] for i in decodes]
        seq_lens = [meta.seq_lens[i] for i in decodes]
        queries = _tiles(q[tokens][:, None], kv_heads)[:, 0]  # [D, kv_heads, rows, dim]
        keys, values = _context(cache, meta.block_tables[decodes], max(seq_lens), block_size)
        positions = torch.tensor(seq_lens, device=q.device)[:, None] - 1
        result = _attend(queries, keys, values, positions.expand(-1, QUERY_TILE), scale, window)
        out[tokens] = _untile(result[:, None])[:, 0]
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = starts[i], starts[i + 1]
        if end - start == 1:
            continue
        keys, values = _context(cache, meta.block_tables[i : i + 1], seq_len, block_size)
        first = seq_len - (end - start)  # position of the chunk's first token
        for g in range(start, end, QUERY_TILE * _QUERY_GROUP):
            stop = min(end, g + QUERY_TILE * _QUERY_GROUP)
            queries = _tiles(q[g:stop].reshape(1, stop - g, q_heads, head_dim), kv_heads)[0]  # [tiles, kv, rows, dim]
            tiles = queries.shape[0]
            positions = torch.arange(first + g - start, first + g - start + tiles * QUERY_TILE, device=q.device)
            positions = positions.clamp_max(first + stop - start - 1).view(tiles, QUERY_TILE)
            num_keys = cdiv(first + stop - start, KEY_TILE) * KEY_TILE
            k = keys[..., :num_keys].expand(tiles, -1, -1, -1)
            v = values[:, :, :num_keys].expand(tiles, -1, -1, -1)
            result = _attend(queries, k, v, positions, scale, window)
            out[g:stop] = _untile(result[None])[0, : stop - g]
    return out.to(q.dtype)


def _tiles(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[S, n, q_heads, dim] -> float32 [S, tiles, kv_heads, QUERY_TILE * group, dim]: each KV head's query rows,
    token-major, the last tile padded by repeating the last token."""
    seqs, num, q_heads, head_dim = q.shape
    padded = cdiv(num, QUERY_TILE) * QUERY_TILE
    if padded != num:
        q = torch.cat([q, q[:, -1:].expand(-1, padded - num, -1, -1)], 1)
    tiles = q.float().view(seqs, padded // QUERY_TILE, QUERY_TILE, kv_heads, q_heads // kv_heads, head_dim)
    tiles = tiles.permute(0, 1, 3, 2, 4, 5).reshape(seqs, padded // QUERY_TILE, kv_heads, -1, head_dim)
    return tiles


def _untile(result: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_tiles``'s layout: [S, tiles, kv_heads, rows, dim] -> [S, tiles * QUERY_TILE, q_heads, dim]."""
    seqs, tiles, kv_heads, _, head_dim = result.shape
    return result.view(seqs, tiles, kv_heads, QUERY_TILE, -1, head_dim).permute(0, 1, 3, 2, 4, 5).reshape(
        seqs, tiles * QUERY_TILE, -1, head_dim)


def _context(cache, block_tables, seq_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys transposed [S, kv_heads, dim, L] and values [S, kv_heads, L, dim] of the first ``seq_len``
    positions' blocks, L padded with zeros to a multiple of KEY_TILE."""
    num_blocks = cdiv(seq_len, block_size)
    blocks = torch.index_select(cache, 0, block_tables[:, :num_blocks].flatten())
    seqs, kv_heads = block_tables.shape[0], cache.shape[2] // 2
    context = blocks.view(seqs, num_blocks * block_size, 2 * kv_heads, -1).float()
    length = cdiv(num_blocks * block_size, KEY_TILE) * KEY_TILE
    if length != context.shape[1]:
        context = torch.nn.functional.pad(context, (0, 0, 0, 0, 0, length - context.shape[1]))
    keys, values = context[:, :, :kv_heads], context[:, :, kv_heads:]
    return keys.permute(0, 2, 3, 1), values.permute(0, 2, 1, 3)


def _attend(q, keys_t, values, positions, scale: float, window: int | None) -> torch.Tensor:
    """q [B, H, R, dim] (R = QUERY_TILE * group rows, token-major), keys_t [B, H, dim, L], values [B, H, L, dim]
    (either may be one sequence's context expanded over B tiles: read in place, never copied), positions
    [B, QUERY_TILE] (each tile token's position; keys are positions 0..L-1) -> [B, H, R, dim]."""
    batch, heads, rows, head_dim = q.shape
    num_keys = keys_t.shape[-1]
    key_pos = torch.arange(num_keys, device=q.device)
    row_pos = positions.repeat_interleave(rows // QUERY_TILE, 1)[:, :, None]  # [B, R, 1]
    hidden = key_pos > row_pos
    if window is not None:
        hidden |= key_pos <= row_pos - window
    out = q.new_empty(batch, heads, rows, head_dim)
    for h in range(heads):
        scores = torch.bmm(q[:, h], keys_t[:, h]).mul_(scale).masked_fill_(hidden, -torch.inf)
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        # Sums in a fixed order: within a key tile (a fixed-length reduction), then tile after tile.
        denom = weights.view(batch, rows, -1, KEY_TILE).sum(-1).cumsum(-1)[..., -1:]
        total = torch.bmm(weights[:, :, :KEY_TILE], values[:, h, :KEY_TILE])
        for k in range(KEY_TILE, num_keys, KEY_TILE):
            total.add_(torch.bmm(weights[:, :, k : k + KEY_TILE], values[:, h, k : k + KEY_TILE]))
        out[:, h] = total.div_(denom)
    return out

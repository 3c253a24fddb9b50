"""Decode attention on the native kernel ``kernels/decode_attention.c``: each decode's query heads straight over
its paged KV blocks (no gathered copy, no padding mask), a KV head's keys and values read once for its query heads,
where PyTorch's path gathers the blocks and masks the padding (docs/model.md#native-kernels). ``kernel()`` is None
where it cannot be built or disagrees with ``reference_attention`` on a probe; callers then keep PyTorch's path."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvprefix.model.native_kernels import probed

# The kernel takes float32 too (the tests check it), but float32 is the reference path that the transformers parity
# tests hold to equal greedy tokens, and transformers attends with PyTorch's kernels: float32 keeps them.
DTYPES = (torch.bfloat16,)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, fn=None) -> torch.Tensor:
    """q [D, heads, dim] attending to the first ``seq_lens[d]`` positions of its blocks ``block_table[d]`` of
    ``cache`` [blocks, block_size, 2 * kv_heads, dim] (K heads, then V heads): [D, heads, dim], q's dtype. On
    ``fn`` (a ``bind``-ing; default ``kernel()``, which must be there)."""
    num, heads, dim = q.shape
    block_size, kv_heads = cache.shape[1], cache.shape[2] // 2
    q, table, lens = q.contiguous(), block_table.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    failed = (fn or kernel())(q.data_ptr(), cache.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(),
                              num, heads, kv_heads, dim, block_size, scale, q.dtype == torch.bfloat16,
                              out.data_ptr(), torch.get_num_threads())
    if failed == -1:
        raise MemoryError(f"decode attention kernel: no scratch memory for {int(lens.max())} positions")
    if failed:
        raise ValueError(f"decode attention kernel: {heads} heads on {kv_heads} KV heads of {dim} (see ``supports``)")
    return out


def reference_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """What the kernel computes, in float64: softmax(q K^T * scale) V over each decode's positions, GQA grouped."""
    num, heads, dim = q.shape
    kv_heads = cache.shape[2] // 2
    out = torch.empty(num, heads, dim, dtype=torch.float64)
    for d in range(num):
        context = cache[block_table[d]].flatten(0, 1)[: int(seq_lens[d])].double().transpose(0, 1)
        keys, values = context[:kv_heads], context[kv_heads:]
        query = q[d].double().view(kv_heads, heads // kv_heads, dim)
        out[d] = (torch.softmax(query @ keys.transpose(1, 2) * scale, -1) @ values).reshape(heads, dim)
    return out


def supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernel runs this call: built, on CPU, q and cache bfloat16 (``DTYPES``), heads it takes."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and cache.dtype == q.dtype
            and supports_heads(q.shape[1], cache.shape[2] // 2, q.shape[2]) and kernel() is not None)


def supports_heads(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the kernel takes these heads: head size up to 256, up to 16 query heads a KV head."""
    return dim <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 16


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in ``lib`` (a build of ``kernels/decode_attention.c``), with its C signature."""
    fn = lib.kvp_decode_attention
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def agrees(fn) -> bool:
    """Whether ``fn`` matches ``reference_attention`` on a probe: both dtypes, a partial last block, two decodes
    of different lengths."""
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        cache = torch.randn(6, 4, 4, 16, generator=generator).to(dtype)
        q = torch.randn(2, 6, 16, generator=generator).to(dtype)
        table, lens = torch.tensor([[5, 0, 3], [2, 4, 1]]), torch.tensor([11, 6])
        out = decode_attention(q, cache, table, lens, 0.25, fn=fn)
        if not torch.allclose(out.double(), reference_attention(q, cache, table, lens, 0.25), rtol=tolerance,
                              atol=tolerance):
            return False
    return True


@functools.cache
def kernel():
    """The kernel's entry point, or None: not built, or not ``agrees``-ing."""
    return probed("decode_attention", bind, agrees)

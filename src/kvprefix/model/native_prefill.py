"""Prefill attention on the native kernel ``kernels/prefill_attention.c``: a bfloat16 chunk's causal attention in
one pass over blocks of keys with an online softmax, scores and weighted values on AVX512-BF16 pair dot products,
where PyTorch's CPU ways (its flash kernel, or query tiles of its matmuls and softmax) make separate passes over
the scores (docs/model.md#native-kernels). ``kernel()`` is None where the CPU lacks AVX512-BF16, no compiler builds
it, or it disagrees with ``reference_attention`` on a probe: ``attention`` then keeps PyTorch's ways."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvprefix.model.native_kernels import probed

BLOCK_KEYS = 64  # keys a block of the kernel (its BLOCK_KEYS): the packed keys and values are padded to it


def prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      scratch: torch.Tensor | None = None, fn=None) -> torch.Tensor:
    """Causal attention of query [new, heads, dim] (bfloat16), the last ``new`` of the positions of keys and values
    [seq, kv_heads, dim]: [new, heads, dim] bfloat16. All three may be views with any token stride (slices of the
    step's q, K and V or of a gathered context) whose heads and dims are contiguous. ``scratch``: bfloat16, at
    least ``scratch_size(seq, kv_heads, dim)`` elements, for the packed keys and values (default: allocated). On
    ``fn`` (a ``bind``-ing; default ``kernel()``, which must be there)."""
    num_new, heads, dim = query.shape
    seq, kv_heads = keys.shape[:2]
    size = scratch_size(seq, kv_heads, dim)
    if scratch is None:
        scratch = torch.empty(size, dtype=torch.bfloat16)
    if scratch.numel() < size or any(x.stride()[1:] != (dim, 1) for x in (query, keys, values)):
        raise ValueError("prefill attention kernel: query, keys and values contiguous by head and dim, and scratch "
                         f"of {size} elements")
    out = torch.empty(query.shape, dtype=query.dtype)
    if (fn or kernel())(query.data_ptr(), query.stride(0), keys.data_ptr(), keys.stride(0), values.data_ptr(),
                        values.stride(0), num_new, seq, heads, kv_heads, dim, scale, scratch.data_ptr(),
                        out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"prefill attention kernel: head size {dim} (a multiple of 64, at most 256)")
    return out


def scratch_size(seq: int, kv_heads: int, dim: int) -> int:
    """bfloat16 elements the kernel packs ``seq`` keys and values into (padded to its blocks)."""
    return 2 * kv_heads * -(-seq // BLOCK_KEYS) * BLOCK_KEYS * dim


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """What the kernel computes, in float64: each query row attending to the keys up to its own position (the
    chunk's rows are the last ``new`` positions), GQA grouped."""
    num_new, heads, _ = query.shape
    seq, kv_heads = keys.shape[:2]
    keys, values = (x.double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for x in (keys, values))
    scores = query.double().transpose(0, 1) @ keys.transpose(1, 2) * scale  # [heads, new, seq]
    later = torch.arange(seq)[None, :] > torch.arange(seq - num_new, seq)[:, None]
    return (torch.softmax(scores.masked_fill(later, -torch.inf), -1) @ values).transpose(0, 1)


def supports(query: torch.Tensor) -> bool:
    """Whether the kernel runs on query [new, heads, dim]: built for this CPU, bfloat16 on CPU, a head size it takes
    (a multiple of 64 up to 256)."""
    return (query.device.type == "cpu" and query.dtype == torch.bfloat16 and query.shape[-1] % 64 == 0
            and query.shape[-1] <= 256 and kernel() is not None)


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in ``lib`` (a build of ``kernels/prefill_attention.c``), with its C signature; None
    where the build has no path for its CPU (no AVX512-BF16)."""
    if not lib.kvp_prefill_supported():
        return None
    fn = lib.kvp_prefill_attention
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def agrees(fn) -> bool:
    """Whether ``fn`` matches ``reference_attention`` on a probe: a cold chunk and one after context, past a block
    of keys and a tile of rows, 3 query heads a KV head, the queries and keys strided views."""
    generator = torch.Generator().manual_seed(0)
    for context, new in ((0, 70), (75, 30)):
        kv = torch.randn(context + new, 4, 64, generator=generator).bfloat16()
        query = torch.randn(new, 8, 64, generator=generator).bfloat16()[:, 1:7]
        got = prefill_attention(query, kv[:, :2], kv[:, 2:], 0.125, fn=fn).double()
        if not torch.allclose(got, reference_attention(query, kv[:, :2], kv[:, 2:], 0.125), rtol=2e-2, atol=2e-2):
            return False
    return True


@functools.cache
def kernel():
    """The kernel's entry point, or None: not built, no path for this CPU, or not ``agrees``-ing."""
    return probed("prefill_attention", bind, agrees)

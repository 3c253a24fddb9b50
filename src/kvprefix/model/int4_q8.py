"""Int4 weights against int8 activation groups on the native kernel ``kernels/q4_q8.c`` (llama.cpp's Q4 x Q8
idea, with a second pass for what the first rounds off): a decode step's rows quantized per group of 32, summed in
int32 on the CPU's u8 x s8 dot products, the weight read once at its 20 bytes a group. About twice PyTorch's int4 op on one row
(docs/model.md#native-kernels). ``kernel()`` is None where it cannot be built or does not agree with
``reference_matmul`` on a probe; callers then keep PyTorch's op."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from kvprefix.model.native_kernels import load

log = logging.getLogger(__name__)
GROUP = 32  # inputs per group: the weights' and the activations' alike


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's form of W = (q - 8) * scale + zero (q [n, k] in 0..15; scale, zero [n, k / 32], used as
    bfloat16): nibbles uint8 [n, k / 32, 16], byte j element j low and j + 16 high (GGUF's order), and scale_zero
    int32 [n, k / 32], the scale's bfloat16 bits low and the zero's high."""
    n, k = q.shape
    groups = q.reshape(n, k // GROUP, GROUP).to(torch.uint8)
    nibbles = (groups[..., :16] | (groups[..., 16:] << 4)).contiguous()
    scale, zero = (_bf16_bits(t) for t in (scales, zeros))
    return nibbles, (scale | (zero << 16)).contiguous()


def matmul(x: torch.Tensor, nibbles: torch.Tensor, scale_zero: torch.Tensor, fn=None) -> torch.Tensor:
    """x [rows, k] @ W.T as [rows, n] in x's dtype (bfloat16 or float32; other dtypes computed in float32), on
    ``fn`` (a ``bind``-ing; default ``kernel()``, which must be there)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous():
        x = x.float().contiguous()
    rows, k = x.shape
    out = torch.empty(rows, nibbles.shape[0], dtype=x.dtype)
    if (fn or kernel())(x.data_ptr(), x.dtype == torch.bfloat16, rows, k, nibbles.data_ptr(), scale_zero.data_ptr(),
                        nibbles.shape[0], out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"q4_q8 kernel: no scratch memory for {rows} rows of {k}")
    return out


def reference_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64 (its float rounding aside): x quantized per group of 32 in its two
    passes (``scaled = x * 127 / max|x|``, ``qx = round(scaled)``, ``qe = min(round((scaled - qx) * 256), 127)``),
    each group's scale * d / 256 * (sum(q * v) - 8 * sum(v)) + zero * sum(x), v = 256 * qx + qe."""
    n, k = q.shape
    xg = x.float().reshape(x.shape[0], 1, k // GROUP, GROUP)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # float32 steps, as the kernel's
    scaled = xg * inv[..., None]
    qx = torch.round(scaled)  # half to even, as nearbyintf
    qe = torch.round((scaled - qx) * 256).clamp(max=127)
    v = (256 * qx + qe).double()
    ints = (q.double().reshape(1, n, k // GROUP, GROUP) * v).sum(-1) - 8 * v.sum(-1)
    scale, zero = (t.to(torch.bfloat16).double()[None] for t in (scales, zeros))
    d = (amax / 127 / 256).double()
    return (ints * scale * d + zero * xg.double().sum(-1)).sum(-1)


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in ``lib`` (a build of ``kernels/q4_q8.c``), with its C signature."""
    fn = lib.kvp_q4_q8_matmul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def agrees(fn) -> bool:
    """Whether ``fn`` matches ``reference_matmul`` on a probe that takes the C source's every branch: whole blocks
    of 8 groups and a tail, tiles of 4 rows and a remainder."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 11 * GROUP), generator=generator)
    scales, zeros = torch.rand(24, 11, generator=generator) / 8, torch.randn(24, 11, generator=generator) / 8
    x = torch.randn(5, 11 * GROUP, generator=generator)
    out = matmul(x, *pack(q, scales, zeros), fn=fn)
    return torch.allclose(out.double(), reference_matmul(x, q, scales, zeros), rtol=1e-4, atol=1e-4)


@functools.cache
def kernel():
    """The kernel's entry point, or None: not built, or not ``agrees``-ing."""
    lib = load("q4_q8")
    if lib is None:
        return None
    fn = bind(lib)
    if not agrees(fn):
        log.warning("native kernel q4_q8 disagrees with its reference on a probe: PyTorch's int4 op instead")
        return None
    return fn


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF

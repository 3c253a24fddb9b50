"""Int4 matmul of a few bfloat16 rows on the native kernel ``kernels/int4_matmul.c``: the weights stay packed
through AVX512-BF16's pair dot products, where PyTorch's int4 op dequantizes every weight before its product and
runs compute-bound at a fraction of the memory bandwidth (docs/model.md#native-kernels). The layer
(``quantized_linear.Int4Linear``) packs its weights with ``pack``; ``kernel()`` is None where the CPU lacks
AVX512-BF16, no compiler builds it, or it disagrees with ``reference_matmul`` on a probe: the layer then keeps
PyTorch's op."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvprefix.model.native_kernels import probed

TILE, GROUP = 16, 32  # outputs a packed tile holds; inputs a (scale, zero) pair covers


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weights, scales and zeros) in the kernel's layout, from q [n, k] (0..15; n a multiple of 16, k of
    32) and scales, zeros [n, k // 32]: per tile of 16 outputs and group of 32 inputs, 4 chunks of 32 16-bit words,
    word 2i + j of chunk c holding output i's q at k = 8c + 2h + j in its nibble h; then each tile's and group's 16
    scales and 16 zeros, bfloat16."""
    n, k = q.shape
    tiles, groups = n // TILE, k // GROUP
    nibbles = q.to(torch.int32).view(tiles, TILE, groups, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)  # t, g, c, i, j, h
    words = nibbles[..., 0] | nibbles[..., 1] << 4 | nibbles[..., 2] << 8 | nibbles[..., 3] << 12
    packed = words.to(torch.int16).contiguous().view(torch.uint8).reshape(-1)  # the int16 wrap keeps the bits

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(tiles, TILE, groups).permute(0, 2, 1)

    return packed, torch.stack([per_tile(scales), per_tile(zeros)], 2).to(torch.bfloat16).contiguous()


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int,
                fn=None) -> torch.Tensor:
    """x [rows, k] (bfloat16, contiguous) @ the packed weight's [n, k].T: [rows, n] bfloat16, on ``fn`` (a
    ``bind``-ing; default ``kernel()``, which must be there)."""
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    if (fn or kernel())(x.data_ptr(), rows, k, packed.data_ptr(), scales_and_zeros.data_ptr(), n, out.data_ptr(),
                        torch.get_num_threads()):
        raise ValueError(f"int4 kernel: {n} outputs and {k} inputs (multiples of {TILE} and {GROUP}), {rows} rows")
    return out


def reference_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: x @ W.T with W[n, k] = (q - 8) * scale + zero (scale and zero rounded
    to bfloat16, as packed)."""
    scales, zeros = (t.to(torch.bfloat16).double().repeat_interleave(GROUP, 1) for t in (scales, zeros))
    return x.double() @ ((q.double() - 8) * scales + zeros).t()


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel runs this call: built for this CPU, x a contiguous bfloat16 CPU matrix."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.is_contiguous() and kernel() is not None


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in ``lib`` (a build of ``kernels/int4_matmul.c``), with its C signature; None where
    the build has no path for its CPU (no AVX512-BF16)."""
    if not lib.kvp_int4_supported():
        return None
    fn = lib.kvp_int4_matmul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def agrees(fn) -> bool:
    """Whether ``fn`` matches ``reference_matmul`` on a probe (two tiles, three groups, 1 and 5 rows) to within
    the bfloat16 rounding of its output."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 96), generator=generator)
    scales, zeros = torch.rand(32, 3, generator=generator) / 8, torch.randn(32, 3, generator=generator) / 8
    packed, scales_and_zeros = pack(q, scales, zeros)
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
        got = int4_matmul(x, packed, scales_and_zeros, 32, fn=fn).double()
        if not torch.allclose(got, reference_matmul(x, q, scales, zeros), rtol=2**-8, atol=1e-6):
            return False
    return True


@functools.cache
def kernel():
    """The kernel's entry point, or None: not built, no path for this CPU, or not ``agrees``-ing."""
    return probed("int4_matmul", bind, agrees)

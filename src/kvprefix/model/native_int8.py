"""Int8 matmul with int8 activations on the native kernel ``kernels/int8_matmul.c``: the two int8 passes per row of
``quantized_linear.int8_rows_matmul`` on AVX512-VNNI's dot products, each weight read once for both passes and
several rows, the passes combined and scaled inside the kernel, where fbgemm's linear and PyTorch's ops around it
left a decode's lm_head well short of the memory bandwidth (docs/model.md#native-kernels). The layer
(``quantized_linear.Int8Linear``) packs its weights with ``pack``; ``kernel()`` is None where the CPU lacks
AVX512-VNNI, no compiler builds it, or it disagrees with ``reference_matmul`` on a probe: the layer then keeps
fbgemm's path."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvprefix.model.native_kernels import probed

TILE, CHUNK = 16, 4  # outputs a packed tile holds; inputs one 32-bit lane of a dot product sums
LEVELS = 127  # a pass's int8 levels on either side of zero, as int8_rows_matmul's
K_MULTIPLE = 16  # inputs a row must come in multiples of


def pack(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weights, scales) in the kernel's layout, from q [n, k] (int8, -127..127; k a multiple of 16) and
    scales [n]: per tile of 16 outputs (n padded with zero weights to a multiple of 16), k / 4 chunks of 64 bytes,
    byte 4i + j of chunk c holding output i's q at k = 4c + j, plus 128 (uint8); the scales as bfloat16, padded."""
    n, k = q.shape
    pad = -n % TILE
    q = torch.nn.functional.pad(q.to(torch.int16), (0, 0, 0, pad))
    tiles = q.view(-1, TILE, k // CHUNK, CHUNK).permute(0, 2, 1, 3)  # tile, chunk, output, input
    packed = (tiles + 128).to(torch.uint8).contiguous().reshape(-1)
    return packed, torch.nn.functional.pad(scales.to(torch.bfloat16), (0, pad)).contiguous()


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, fn=None) -> torch.Tensor:
    """x [rows, k] (bfloat16 or float32, contiguous) @ the packed weight's [n, k].T: [rows, n] float32, on ``fn``
    (a ``bind``-ing; default ``kernel()``, which must be there)."""
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    if (fn or kernel())(x.data_ptr(), x.dtype == torch.bfloat16, rows, k, packed.data_ptr(), scales.data_ptr(), n,
                        out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"int8 kernel: {k} inputs (a multiple of {K_MULTIPLE}), {rows} rows, {n} outputs")
    return out


def reference_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: each row of x as its two int8 passes (float32 steps as
    ``int8_rows_matmul``'s: s = x / max|x| * 127, a1 = round(s), a2 = round((s - a1) * 254)), that is
    (254 a1 + a2) * max|x| / (127 * 254), times W = q * scale (scale rounded to bfloat16, as packed)."""
    x = x.float()
    row_max = x.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = x.div(row_max).mul(LEVELS)
    first = scaled.round()
    second = (scaled - first).mul(2 * LEVELS).round()
    x_hat = (first.double() * (2 * LEVELS) + second.double()) * row_max.double() / (LEVELS * 2 * LEVELS)
    return x_hat @ (q.double() * scales.to(torch.bfloat16).double()[:, None]).t()


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel runs this call: built for this CPU, x a contiguous bfloat16 or float32 CPU matrix with
    a multiple of 16 inputs."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous()
            and x.shape[-1] % K_MULTIPLE == 0 and kernel() is not None)


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in ``lib`` (a build of ``kernels/int8_matmul.c``), with its C signature; None where
    the build has no path for its CPU (no AVX512-VNNI)."""
    if not lib.kvp_int8_supported():
        return None
    fn = lib.kvp_int8_matmul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def agrees(fn) -> bool:
    """Whether ``fn`` matches ``reference_matmul`` on a probe (two tiles, the second partial; 1 and 5 rows;
    bfloat16 and float32) to within the float32 roundings of its last steps."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (27, 48), generator=generator, dtype=torch.int8)
    scales = torch.rand(27, generator=generator) / 8
    packed, packed_scales = pack(q, scales)
    for rows, dtype in ((1, torch.bfloat16), (5, torch.float32)):
        x = torch.randn(rows, 48, generator=generator).to(dtype)
        got = int8_matmul(x, packed, packed_scales, 27, fn=fn).double()
        if not torch.allclose(got, reference_matmul(x, q, scales), rtol=1e-6, atol=1e-12):
            return False
    return True


@functools.cache
def kernel():
    """The kernel's entry point, or None: not built, no path for this CPU, or not ``agrees``-ing."""
    return probed("int8_matmul", bind, agrees)

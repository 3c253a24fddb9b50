"""RMSNorm on the native kernel ``kernels/rms_norm.c``: one pass over each row with the reference's roundings,
where PyTorch's CPU path dispatches ~8 ops a call (docs/model.md#native-kernels). ``kernel()`` is None where it
cannot be built or disagrees with PyTorch's RMSNorm on a probe; callers then keep PyTorch's ops."""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kvprefix.model.native_kernels import probed

# As decode attention (native_attention.DTYPES): float32 stays on PyTorch's ops, the transformers parity path.
DTYPES = (torch.bfloat16,)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fn=None) -> torch.Tensor:
    """RMSNorm of x's last dimension (x contiguous, x and weight both bfloat16 or both float32), in x's dtype, on
    ``fn`` (a ``bind``-ing; default ``kernel()``, which must be there)."""
    out = torch.empty_like(x)
    size = x.shape[-1]
    (fn or kernel())(x.data_ptr(), weight.data_ptr(), x.numel() // size, size, eps, x.dtype == torch.bfloat16,
                     out.data_ptr(), torch.get_num_threads())
    return out


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch's RMSNorm as the model runs it without the kernel: normalized in float32, rounded to x's dtype, then
    scaled by the weight (transformers' rounding)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x, weight.shape, None, eps) * weight


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel runs this call: built, on CPU, x contiguous, x and weight bfloat16 (``DTYPES``)."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype == x.dtype and x.is_contiguous()
            and kernel() is not None)


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in ``lib`` (a build of ``kernels/rms_norm.c``), with its C signature."""
    fn = lib.kvp_rms_norm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return fn


def agrees(fn) -> bool:
    """Whether ``fn`` matches ``reference_rms_norm`` on a probe (both dtypes, a row length that is not a multiple
    of 8): float32 to its rounding, bfloat16 to within one rounding of the last step (the squares' sum may differ
    in its last bit)."""
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        x = (torch.randn(3, 37, generator=generator) * 3).to(dtype)
        weight = torch.rand(37, generator=generator).to(dtype)
        got, expected = rms_norm(x, weight, 1e-5, fn=fn).float(), reference_rms_norm(x, weight, 1e-5).float()
        if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance):
            return False
    return True


@functools.cache
def kernel():
    """The kernel's entry point, or None: not built, or not ``agrees``-ing."""
    return probed("rms_norm", bind, agrees)

"""Rotary embedding and SiLU-and-multiply on the native kernel ``kernels/layer_ops.c``: one pass each where
PyTorch dispatches three ops (flip, mul_, addcmul_) and two (silu, mul_). The fused decode (``native_decode``)
runs the same functions, and the model's forward takes them for bfloat16 (SiLU up to ``SILU_MUL_ROWS`` rows), so a
decode computes the same bits on either path (docs/model.md#native-kernels). ``kernels()`` is None where they
cannot be built or disagree with PyTorch's ops on a probe: callers then keep PyTorch's ops."""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvprefix.model.native_kernels import probed


class Kernels(NamedTuple):
    rotary: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fns: Kernels | None = None) -> torch.Tensor:
    """x [T, heads, dim] (bfloat16; heads contiguous within a token) rotated in place by cos and signed sin
    [T, 1, dim] (``rope.apply_rotary_``'s factors); returns x. On ``fns`` (default ``kernels()``)."""
    tokens, heads, dim = x.shape
    failed = (fns or kernels()).rotary(x.data_ptr(), tokens, heads, dim, x.stride(0), cos.contiguous().data_ptr(),
                                       sin.contiguous().data_ptr(), torch.get_num_threads())
    if failed:
        raise ValueError(f"rotary kernel: head size {dim} (even, at most 256)")
    return x


def silu_mul(gate_up: torch.Tensor, inner: int, fns: Kernels | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * inner] (bfloat16, contiguous; gate first): [..., inner]."""
    out = gate_up.new_empty(*gate_up.shape[:-1], inner)
    (fns or kernels()).silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * inner), inner, out.data_ptr(),
                                torch.get_num_threads())
    return out


def reference_silu_mul(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """PyTorch's ops for ``silu_mul``: silu of the gate, rounded, times up (silu's output is a fresh contiguous
    tensor: the product lands in it, in place)."""
    return F.silu(gate_up[..., :inner]).mul_(gate_up[..., inner:])


# Rows up to which the model's MLP takes ``silu_mul``: decode-sized batches, those the fused decode takes (as many as
# an int4 layer runs its kernel for), so both compute the same bits. Beyond, PyTorch's vectorized silu is faster
# (docs/model.md#native-kernels); the two round to the same bfloat16 but at rare near-ties.
SILU_MUL_ROWS = 16


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels run on x: built, on CPU, bfloat16."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and kernels() is not None


def supports_silu_mul(gate_up: torch.Tensor) -> bool:
    """Whether the model's MLP runs ``silu_mul`` on gate_up: ``supports``, contiguous, up to ``SILU_MUL_ROWS``
    rows."""
    return supports(gate_up) and gate_up.is_contiguous() and gate_up.numel() <= SILU_MUL_ROWS * gate_up.shape[-1]


def bind(lib: ctypes.CDLL) -> Kernels:
    """The kernels' entry points in ``lib`` (a build of ``kernels/layer_ops.c``), with their C signatures."""
    rotary, silu = lib.kvp_rotary, lib.kvp_silu_mul
    rotary.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    rotary.restype = ctypes.c_int
    silu.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    silu.restype = None
    return Kernels(rotary, silu)


def agrees(fns: Kernels) -> bool:
    """Whether ``fns`` match PyTorch's ops on a probe to within one bfloat16 rounding (rotary: the same roundings,
    equal but where the compiler's float steps differ; SiLU: another exp, equal but near a rounding's tie), on a
    strided view for rotary and a width that is not a multiple of 8 for SiLU."""
    from kvprefix.model.rope import rotate_with_ops_  # rope dispatches to this module

    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 5, 8, generator=generator).bfloat16()
    angles = torch.rand(3, 1, 4, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).bfloat16(), torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()
    got = rotary_(qkv.clone()[:, :3], cos, sin, fns=fns)
    expected = rotate_with_ops_(qkv.clone()[:, :3], cos, sin)
    gate_up = (torch.randn(2, 2 * 19, generator=generator) * 4).bfloat16()
    return (torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=2**-7)
            and torch.allclose(silu_mul(gate_up, 19, fns=fns).float(), reference_silu_mul(gate_up, 19).float(),
                               rtol=2**-7, atol=2**-7))


@functools.cache
def kernels() -> Kernels | None:
    """The kernels' entry points, or None: not built, or not ``agrees``-ing."""
    return probed("layer_ops", bind, agrees)

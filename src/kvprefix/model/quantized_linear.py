"""Compact int8/int4 linear layers for CPU inference on PyTorch's ops (decode is bound by the weight bytes a step
reads).

``Int8Linear``: ``w = q * scale`` per output channel. ``Int4Linear``: groups of 32 along the input,
``w = (q - 8) * scale + zero``, q in 0..15 (the tinygemm convention). The int4 op and the int8 weight-only op are
fast only with bfloat16 activations, so those layers compute in bfloat16 and return the caller's dtype, and above
``dense_above_rows`` rows take a dense matmul (an int4 layer keeps its dense copy for it: the int4 op's cost grows
with every row). Where PyTorch's fbgemm u8s8 kernel sums exactly (probed at
import: ``INT8_ACTIVATIONS``; x86 with VNNI) an int8 layer runs on int8 activations instead, its input in two int8
passes per row (``int8_rows_matmul``: the row, then its rounding error), which is as exact as bfloat16 activations,
faster on a wide matrix such as the lm_head, and batch invariant (docs/model.md): on the native kernel
(``native_int8``) where it builds, on fbgemm elsewhere.
``quantize_model`` swaps a loaded model's projections and lm_head; ``pack_gguf_tensors`` builds one from GGUF blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import gguf
import numpy as np
import torch
from torch import nn

from kvprefix.cache.identity import NO_QUANTIZATION, QUANTIZATION_CHOICES, QUANTIZATION_METHODS
from kvprefix.model import native_int4, native_int8
from kvprefix.model.gguf_loader import _LAYER_NAMES, unpermute_rows
from kvprefix.model.loader import native_bfloat16_cpu
from kvprefix.tokenizer.gguf_file import GGUFFile, open_gguf

GROUP_SIZE = 32  # int4 group along the input dimension; also the block size of GGUF's Q4_0/Q4_1/Q8_0
_COMPUTE = torch.bfloat16  # the ops' activations
# Prefill-sized inputs dequantize and take a dense matmul (the ops are matrix-vector kernels); docs/model.md.
_DENSE = torch.bfloat16 if native_bfloat16_cpu() else torch.float32
_N_ALIGN = 16  # the int4 packing needs a multiple of 16 output channels: pad with zero rows
_ACT_LEVELS = 127  # an int8 activation row: round(x / max|x| * 127), stored as uint8 with zero point 128


def pack_int8_weight(q: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed form of int8 weights ``q`` [out, in] with per-output-channel ``scales`` (values exact)."""
    with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch, their CPU kernels not replaced
        warnings.simplefilter("ignore")
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(q.contiguous(), scales.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


def int8_rows_matmul(x: torch.Tensor, packed) -> torch.Tensor:
    """x [rows, in] (float32) @ the packed weight, float32 out, with x in two int8 passes per row: each row scaled
    by its own max|x| and rounded to 255 levels, then its rounding error scaled up and rounded the same way, so x
    is represented to about 1/64,000 of its row's max (bfloat16 keeps 1/512 of each value). One pass alone
    (255 levels a row) moved this model's logits by ~10x the KL of the int4 weights (docs/model.md). Both passes
    are rows of one call, so the weight is read once. The kernel sums u8 x s8 products in int32 (exact) and scales
    per element: a row's result is independent of the others."""
    rows = x.shape[0]
    row_max = x.abs().amax(1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
    scaled = x.div(row_max).mul_(_ACT_LEVELS)  # in [-127, 127]: the kernel rounds it to the first pass's levels
    error = (scaled - scaled.round()).mul_(2 * _ACT_LEVELS)  # what that rounding leaves, scaled to [-127, 127]
    out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(torch.cat([scaled, error]), 1.0, 128,
                                                                            packed)
    return out[:rows].add_(out[rows:], alpha=0.5 / _ACT_LEVELS).mul_(row_max / _ACT_LEVELS)


def _probe_int8_activations() -> bool:
    """Whether this build has fbgemm's u8s8 linear and its sums are exact at full range: without VNNI, x86 pairs
    u8 x s8 products in saturating int16 adds (2 * 255 * 127 overflows), which this catches."""
    try:
        q = torch.full((16, 64), 127, dtype=torch.int8)
        q[1::2] = -127
        got = int8_rows_matmul(torch.ones(2, 64), pack_int8_weight(q, torch.ones(16)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool((got == torch.tensor([127.0, -127.0] * 8) * 64).all())


INT8_ACTIVATIONS = _probe_int8_activations()


def kv_method(method: str | None) -> str | None:
    """``method`` as the block identity names it (``cache.identity.kv_label``): with "+a8" where the layers quantize
    activations to int8, which computes other KV than the weight-only kernels (docs/hashing.md)."""
    return None if method is None else method + ("+a8" if INT8_ACTIVATIONS else "")


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T + bias, with q int8 [out, in] and scale bfloat16 [out]: on int8 activations
    above ``int8_activations_above_rows`` rows where ``int8_activations`` (default ``INT8_ACTIVATIONS``), on the
    native kernel where this CPU has it (``native_qweight``: packed in its layout) else on fbgemm's
    (``int8_rows_matmul``: ``packed``); else the weight-only op."""

    dense_above_rows = 32  # weight-only: above this many rows, dequantize then matmul (docs/model.md)
    # One row of a projection takes the weight-only op (on fbgemm, two passes' small ops cost more than they save);
    # ``quantize_model`` sets 0 for the lm_head, where int8 activations are faster from one row (docs/benchmarks.md).
    int8_activations_above_rows = 1
    # The lm_head keeps the float32 sums of int8 activations as its logits (``quantize_model``): rounded to the
    # model's bfloat16, this model's near-ties became exact ties (docs/model.md#compact-weights---quantization-cpu).
    keeps_float32 = False

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 int8_activations: bool | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(_COMPUTE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        if int8_activations is None:
            int8_activations = INT8_ACTIVATIONS
        # The native kernel's packing where it runs on this CPU, in place of fbgemm's: it is faster at every row
        # count measured, 1 to 2,048 (docs/model.md#native-kernels), so fbgemm's copy would only take memory.
        native = (int8_activations and self.in_features % native_int8.K_MULTIPLE == 0
                  and native_int8.kernel() is not None)
        native_qweight, native_scales = native_int8.pack(self.qweight, self.scales) if native else (None, None)
        self.register_buffer("native_qweight", native_qweight)
        self.register_buffer("native_scales", native_scales)
        # The scales as the op sees them (bfloat16 values, exact in float64): one product, rounded once.
        use_fbgemm = int8_activations and not native
        self.packed = pack_int8_weight(self.qweight, self.scales.float()) if use_fbgemm else None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   int8_activations: bool | None = None) -> Int8Linear:
        return cls(*int8_from_float(weight), bias, int8_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = _rows(x, self.in_features)
        if self.native_qweight is not None and flat.shape[0] > self.int8_activations_above_rows:
            rows = flat if flat.dtype in (torch.bfloat16, torch.float32) else flat.float()
            out = native_int8.int8_matmul(rows.contiguous(), self.native_qweight, self.native_scales,
                                          self.out_features)
        elif self.packed is not None and flat.shape[0] > self.int8_activations_above_rows:
            out = int8_rows_matmul(_as(flat, torch.float32), self.packed)
        elif flat.shape[0] > self.dense_above_rows:
            out = _as(flat, _DENSE) @ self.dequantize().t()
        else:
            out = torch.ops.aten._weight_int8pack_mm(_as(flat, _COMPUTE), self.qweight, self.scales)
        return _finish(out, self.bias, x, self.out_features, self.keeps_float32 and out.dtype == torch.float32)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the dense path's dtype (q fits bfloat16 exactly: one rounding there)."""
        return self.qweight.to(_DENSE) * self.scales[:, None].to(_DENSE)

    def nbytes(self) -> int:
        return _nbytes(self.qweight, self.scales, self.bias)


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], g = k // 32, q in 0..15: on the
    native kernel where this CPU has it (``native``: packed in its layout), else on PyTorch's int4 op."""

    # Above this many rows the dense copy's matmul is faster than the int4 op, whose cost grows with every row;
    # below, reading the copy's 4x the bytes costs more (docs/model.md#compact-weights---quantization-cpu).
    dense_above_rows = 16 if _DENSE == torch.bfloat16 else 128

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % GROUP_SIZE:
            raise ValueError(f"int4 weights need an input dimension divisible by {GROUP_SIZE}, got {self.in_features}")
        pad = -self.out_features % _N_ALIGN
        q, scales, zeros = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, scales, zeros))
        # The native kernel's packing where it runs on this CPU (docs/model.md#native-kernels), else the op's:
        # [in // 32, out, 2] (scale, zero) per group and output channel.
        self.native = native_int4.kernel() is not None
        if self.native:
            packed, scales_and_zeros = native_int4.pack(q, scales, zeros)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            scales_and_zeros = torch.stack([scales.t(), zeros.t()], -1).to(_COMPUTE).contiguous()
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # The weight as the op computes it (scale and zero in bfloat16, the product in float32), in the dense
        # path's dtype: batches and prefill multiply by it. Kept, not rebuilt per call: dequantizing costs more
        # than a 32-row matmul.
        self.register_buffer("dense", _int4_weight(q, scales, zeros).to(_DENSE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        """Asymmetric min/max per group of 32: scale = (max - min) / 15, zero = the value at q = 8 (both bfloat16)."""
        w = weight.detach().float()
        n, k = w.shape
        if k % GROUP_SIZE:
            raise ValueError(f"int4 weights need an input dimension divisible by {GROUP_SIZE}, got {k}")
        groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(_COMPUTE).float()
        zeros = (lo + 8 * scales).to(_COMPUTE).float()
        q = torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15)
        return cls(q.reshape(n, k), scales, zeros, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = _rows(x, self.in_features)
        if flat.shape[0] > self.dense_above_rows:
            out = _as(flat, _DENSE) @ self.dense.t()
        elif self.native:
            out = native_int4.int4_matmul(_as(flat, _COMPUTE).contiguous(), self.qweight, self.scales_and_zeros,
                                          self.dense.shape[0])
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(_as(flat, _COMPUTE), self.qweight, GROUP_SIZE,
                                                             self.scales_and_zeros)
        return _finish(out, self.bias, x, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight [out (padded to 16), in] in the dense path's dtype, as the op computes it."""
        return self.dense

    def nbytes(self) -> int:
        """What a step of up to ``dense_above_rows`` rows reads (not the dense copy)."""
        return _nbytes(self.qweight, self.scales_and_zeros, self.bias)


# _rows, _as and _finish skip no-op reshapes and casts (every projection of a decode step calls them).
def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as a [rows, in] matrix."""
    return x if x.dim() == 2 else x.reshape(-1, in_features)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _finish(out: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, out_features: int,
            keep_dtype: bool = False) -> torch.Tensor:
    if out.shape[1] != out_features:
        out = out[:, :out_features]  # drops the int4 padding rows
    if out.dtype != x.dtype and not keep_dtype:
        out = out.to(x.dtype)  # back to the model's dtype
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_features)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---- GGUF blocks


def pack_gguf_tensors(file: str | GGUFFile, parts: Sequence[tuple[str, torch.Tensor | None]],
                      bias: torch.Tensor | None = None) -> Int4Linear | Int8Linear:
    """The linear layer for GGUF tensors ``parts`` of ``file`` (a path or a reader) stacked along the output.

    Each part is (tensor name, row order or None); the row order undoes llama.cpp's q/k permutation (lossless:
    blocks run along the input). Q4_0/Q4_1 map onto int4 exactly (d and m rounded to bfloat16); every other type,
    or a stack mixing types, is re-quantized to per-channel int8 (``Int8Linear.from_float``).
    """
    reader = open_gguf(file) if isinstance(file, str) else file
    weights = [_gguf_weight(reader, name, rows) for name, rows in parts]
    if all(isinstance(w, tuple) for w in weights):
        q, scales, zeros = (torch.cat(t) for t in zip(*weights, strict=True))
        return Int4Linear(q, scales, zeros, bias)
    dense = [_int4_weight(*w) if isinstance(w, tuple) else w for w in weights]
    return Int8Linear.from_float(torch.cat(dense), bias)


def _gguf_weight(reader: GGUFFile, name: str, rows: torch.Tensor | None):
    """(q, scales, zeros) of a Q4_0/Q4_1 tensor, as Int4Linear takes them; else the float32 weight."""
    tensor = reader.tensors.get(name)
    if tensor is None:
        raise ValueError(f"GGUF file has no tensor {name!r}")
    out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dims innermost first
    kind = tensor.tensor_type
    raw = np.asarray(tensor.data)
    if kind in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        blocks = torch.from_numpy(raw.reshape(out_features, in_features // GROUP_SIZE, -1).copy())
        scales = _f16(blocks[..., 0:2])
        if kind == gguf.GGMLQuantizationType.Q4_1:
            zeros, nibbles = _f16(blocks[..., 2:4]) + 8 * scales, blocks[..., 4:]
        else:
            zeros, nibbles = torch.zeros_like(scales), blocks[..., 2:]
        # A block's 16 bytes hold elements 0..15 in their low nibbles and 16..31 in their high nibbles.
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], -1).reshape(out_features, in_features)
        return tuple(_reorder(t, rows) for t in (q, scales, zeros))
    weight = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(out_features, in_features).copy())
    return _reorder(weight, rows)


def int8_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scales [out]) of ``weight``: symmetric per output channel, scale = max|w| / 127 rounded to
    bfloat16 (the weight-only op's scale dtype) before q is chosen."""
    w = weight.detach().float()
    scales = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(_COMPUTE).float()
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _int4_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight of int4 parts, as Int4Linear computes it (scale and zero rounded to bfloat16)."""
    scales, zeros = scales.to(_COMPUTE).float(), zeros.to(_COMPUTE).float()
    groups = (q.float() - 8).reshape(q.shape[0], -1, GROUP_SIZE) * scales[..., None] + zeros[..., None]
    return groups.reshape(q.shape)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _reorder(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def gguf_rows_from_permuted(out_features: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: ``gguf_weight[rows]`` is the Hugging Face weight
    (the loader's ``unpermute_rows`` applied to the row indices)."""
    return torch.from_numpy(unpermute_rows(np.arange(out_features), num_heads))


# Checkpoint module (within a layer) -> GGUF tensor name (within blk.N): the loader's names, inverted.
_GGUF_NAMES = {hf: g for g, hf in _LAYER_NAMES.items() if hf.endswith("_proj")}


# ---- the hook


@torch.no_grad()
def quantize_model(model: nn.Module, method: str | None, gguf_path: str | None = None) -> nn.Module:
    """Swaps a loaded CausalLM's projections and lm_head for weight-only quantized layers, in place; returns it.

    ``method``: None keeps dense weights; "int8"/"int4" re-quantize the loaded weights; "gguf" packs each projection
    from the blocks of ``gguf_path`` (the file the model was loaded from). Embedding, norms, biases and KV cache stay
    dense.
    """
    if method is None:
        return model
    resolve_quantization(method, gguf_path or "", next(model.parameters()).device)
    config = model.config
    reader = open_gguf(gguf_path) if method == "gguf" else None  # the file the loader parsed already
    # llama.cpp permutes q/k rows only in "llama" files (Qwen's keep the NeoX rotation): as the loader undoes it.
    llama_rows = reader is not None and reader.architecture == "llama"
    permuted_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads} if llama_rows else {}
    for i, layer in enumerate(model.model.layers):
        for name, linear in list(layer.named_modules()):
            if not isinstance(linear, nn.Linear):
                continue
            parent_name, attr = name.rsplit(".", 1)
            if method == "gguf":
                parts = []  # (GGUF tensor, row order) of each checkpoint projection stacked in this one
                for part, rows in getattr(linear, "parts", {attr: linear.out_features}).items():
                    gguf_name = _GGUF_NAMES[f"{parent_name}.{part}"]
                    heads = permuted_heads.get(gguf_name)
                    order = None if heads is None else gguf_rows_from_permuted(rows, heads)
                    parts.append((f"blk.{i}.{gguf_name}.weight", order))
                new = pack_gguf_tensors(reader, parts, linear.bias)
            else:
                new = _from_float(method, linear)
            setattr(layer.get_submodule(parent_name), attr, new)
    if method == "gguf":
        head = "output.weight" if "output.weight" in reader.tensors else "token_embd.weight"  # tied: the embedding
        model.lm_head = pack_gguf_tensors(reader, [(head, None)])
    else:
        model.lm_head = _from_float(method, model.lm_head)
    if isinstance(model.lm_head, Int8Linear):
        model.lm_head.int8_activations_above_rows = 0
        model.lm_head.keeps_float32 = True
    return model


def resolve_quantization(method: str | None, path: str, device: torch.device | str) -> str | None:
    """The compact method to serve ``path`` with on ``device`` (None: dense), or a ValueError, before any loading,
    for one this build cannot run there. ``NO_QUANTIZATION`` asks for dense weights; None is the default: a .gguf
    file whose projections are stored quantized runs its own blocks ("gguf"), as llama.cpp and Ollama run a file,
    where ``compact_by_default`` holds; everything else stays dense."""
    if method == NO_QUANTIZATION:
        return None
    if method is None:
        quantized = torch.device(device).type == "cpu" and path.endswith(".gguf") and _stores_quantized(path)
        return "gguf" if quantized and compact_by_default() else None
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unsupported quantization {method!r}; accepted: {', '.join(QUANTIZATION_CHOICES)}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization {method!r} runs on device cpu only (PyTorch's CPU kernels), not {device}")
    if method == "gguf" and not path.endswith(".gguf"):
        raise ValueError(f"quantization 'gguf' needs a .gguf checkpoint, got {path!r}")
    return method


def compact_by_default() -> bool:
    """Whether this CPU runs the compact path as measured (docs/model.md): int8 activations (VNNI), which give the
    lm_head float32 logits, and native bfloat16 matmuls for prefill. Elsewhere the weight-only op hands back logits
    rounded to bfloat16, which tips this model's near-ties (its first token for "What is the capital of France?")."""
    return INT8_ACTIVATIONS and native_bfloat16_cpu()


def _stores_quantized(path: str) -> bool:
    """Whether the GGUF file's first layer keeps its projections in a quantized type (not F32, F16 or BF16)."""
    dense = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    tensors = open_gguf(path).tensors
    first_layer = (tensors.get(f"blk.0.{name}.weight") for name in _GGUF_NAMES.values())
    return any(t is not None and t.tensor_type not in dense for t in first_layer)


def _from_float(method: str, linear: nn.Module) -> Int4Linear | Int8Linear:
    cls = Int8Linear if method == "int8" else Int4Linear
    return cls.from_float(linear.weight, linear.bias)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the projection and lm_head weights (with scales and biases): what one decode step reads of them."""
    total = 0
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            total += module.nbytes()
        elif isinstance(module, nn.Linear):
            total += _nbytes(module.weight, module.bias)
    return total

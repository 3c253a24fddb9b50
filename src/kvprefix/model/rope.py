"""Rotary position embedding: inverse frequencies per rope type, and applying cos/sin to q and k."""

from __future__ import annotations

import math

import torch

from kvprefix.model import native_layer_ops
from kvprefix.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim // 2] on CPU, computed exactly as transformers does so logits match bit for bit."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    params = config.rope_parameters
    if "freq_factors" in params:  # a GGUF's rope_freqs tensor (Llama 3.1+), as llama.cpp applies it
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32, device="cpu")
    if config.rope_type == "linear":
        return inv_freq / params["factor"]
    if config.rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: the model is built on the meta device and this must stay real.
        self._inv_freq = inverse_frequencies(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of shape [T, 1, head_dim] for int64 positions [T], computed once per forward for all
        layers: cos repeated for the two halves, sin negated on the first (``apply_rotary_``'s factors)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None, None] * self._inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] (q and k heads, a view into the projection's output) in place, as the
    reference's ``x * cos + rotate_half(x) * sin`` written ``x * cos + swap_halves(x) * signed_sin``, with the
    reference's rounding (negating sin is exact): on the native kernel for bfloat16 (one pass, the same steps),
    else ``rotate_with_ops_``."""
    if native_layer_ops.supports(x):
        return native_layer_ops.rotary_(x, cos, signed_sin)
    return rotate_with_ops_(x, cos, signed_sin)


def rotate_with_ops_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_`` in PyTorch's ops: one copy and two in-place ops."""
    tokens, heads, dim = x.shape
    swapped = x.view(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)
    return x.mul_(cos).addcmul_(swapped, signed_sin)

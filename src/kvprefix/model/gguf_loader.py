"""Weights of a GGUF checkpoint: each tensor renamed to the decoder's parameter name and dequantized to float32
with the `gguf` package (every type it implements), once, at load; ``quantize_model`` may re-pack them compact.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from kvprefix.model.config import ModelConfig
from kvprefix.tokenizer.gguf_file import GGUFFile

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Derived, not learned: the rope divisors are read into the config (rope_parameters["freq_factors"]).
_NOT_PARAMETERS = ("rope_freqs.weight",)


def parameter_name(gguf_name: str) -> str | None:
    """The decoder's parameter for a GGUF tensor name; None for a name it has no parameter for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def dequantize(gguf: GGUFFile, name: str) -> np.ndarray:
    """float32 array in PyTorch's dimension order (GGUF lists the fastest-varying dimension first)."""
    from gguf import quants

    tensor = gguf.tensors[name]
    try:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"{gguf.path}: tensor {name!r} has type {tensor.tensor_type.name}, which the gguf "
                         f"package cannot dequantize ({e})") from None
    return values.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's conversion of Llama q/k projections: per head, it interleaves the two halves of the
    rotary dimensions (rows 0, d/2, 1, d/2+1, ...) for its interleaved RoPE; this decoder rotates halves."""
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def gguf_parameters(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, str, np.ndarray]]:
    """(GGUF name, parameter name, float32 values) for every tensor of the file, in file order."""
    # Only the "llama" architecture is converted with permuted q/k rows; Qwen's use llama.cpp's NeoX rotation.
    permuted = gguf.architecture == "llama"
    for name in gguf.tensors:
        if name in _NOT_PARAMETERS:
            continue
        target = parameter_name(name)
        if target is None:
            raise ValueError(f"{gguf.path}: unexpected tensor {name!r} for a {config.model_type} model")
        values = dequantize(gguf, name)
        if permuted and ".self_attn.q_proj." in target:
            values = unpermute_rows(values, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in target:
            values = unpermute_rows(values, config.num_key_value_heads)
        yield name, target, values

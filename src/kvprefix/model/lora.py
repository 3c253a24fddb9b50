"""LoRA adapters in the PEFT format, applied batched: one forward serves the base model and several adapters.

``load_lora_adapter`` reads ``adapter_config.json`` and ``adapter_model.safetensors``, checks them against the model
(one-line ``ValueError``s) and keeps, per layer and projection, ``A`` [R, in] and ``B`` [out, R]: the A's of a
stacked projection's targeted parts one above the other, B block-diagonal with the scaling folded in, so a stacked
projection (q/k/v, gate/up) takes two matmuls per adapter. ``LoraLayers`` hooks the model's projections: each adds,
for every adapter present in the step, ``x[rows] @ A.T @ B.T`` to its rows, which the caller made contiguous
(sequences grouped by adapter; the segmented form of punica's and S-LoRA's batched kernels, arXiv:2310.18547 and
arXiv:2311.03285). Requests of the base model cost nothing extra; an adapter costs its low-rank products.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from kvprefix.cache.identity import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_fingerprint
from kvprefix.model.config import ModelConfig
from kvprefix.model.llama import CausalLM

# The projections of a decoder layer: checkpoint name -> our module (q/k/v and gate/up are stacked ones).
_PROJECTIONS = {
    "q_proj": "self_attn.qkv_proj",
    "k_proj": "self_attn.qkv_proj",
    "v_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_up_proj",
    "up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}
TARGET_MODULES = tuple(_PROJECTIONS)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_OPTIONS = {  # PEFT options that change the math this module implements
    "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern", "modules_to_save": "modules_to_save",
}


@dataclass
class LoraAdapter:
    """A loaded adapter: ``fingerprint`` names its content (config and weights), ``weights`` maps
    (layer, our module name) to (A [R, in], B [out, R] scaled)."""

    path: str
    fingerprint: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_lora_adapter(path: str, model: CausalLM, max_rank: int) -> LoraAdapter:
    """The PEFT adapter in directory ``path`` for ``model``; a one-line ``ValueError`` naming the adapter and what is
    wrong: a missing file, rank over ``max_rank``, a target module or layer the model lacks, a shape unlike the
    base's, or a PEFT option this engine does not apply."""
    where = f"LoRA adapter {path!r}"
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"{where}: missing {name} (a PEFT adapter directory has {ADAPTER_CONFIG_FILE} and "
                             f"{ADAPTER_WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, ADAPTER_CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read {ADAPTER_CONFIG_FILE}: {e}") from None
    rank, scaling = _rank_and_scaling(where, config)
    if rank > max_rank:
        raise ValueError(f"{where} has rank {rank}, over the limit max_lora_rank={max_rank}")
    tensors = _read_tensors(where, path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{where}: weight {key!r} is not a LoRA A/B of a decoder projection; supported target "
                             f"modules: {', '.join(TARGET_MODULES)}")
        layer, module, ab = int(match.group(1)), match.group(2), match.group(3)
        if module not in _PROJECTIONS:
            raise ValueError(f"{where} targets module {module!r}, which this model lacks; supported target "
                             f"modules: {', '.join(TARGET_MODULES)}")
        if layer >= model.config.num_hidden_layers:
            raise ValueError(f"{where} has weights for layer {layer}; the model has "
                             f"{model.config.num_hidden_layers} layers")
        pairs.setdefault((layer, module), {})[ab] = tensor
    if not pairs:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS_FILE} holds no LoRA weights")
    weights = _stack(where, model, pairs, rank, scaling)
    return LoraAdapter(os.path.realpath(path), adapter_fingerprint(path), rank, weights)


def _rank_and_scaling(where: str, config: dict) -> tuple[int, float]:
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: {ADAPTER_CONFIG_FILE} is not a LoRA config (peft_type must be LORA)")
    for key, what in _REFUSED_OPTIONS.items():
        if config.get(key):
            raise ValueError(f"{where} uses {what}, which kvprefix does not apply")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where} trains biases (bias={config['bias']!r}); only bias='none' is supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: rank 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: 'lora_alpha' must be a number, got {alpha!r}")
    return rank, alpha / (rank**0.5 if config.get("use_rslora") else rank)


def _read_tensors(where: str, path: str) -> dict[str, torch.Tensor]:
    try:
        with safe_open(os.path.join(path, ADAPTER_WEIGHTS_FILE), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own errors for a damaged file
        raise ValueError(f"{where}: cannot read {ADAPTER_WEIGHTS_FILE}: {e}") from None


def _layouts(config: ModelConfig) -> dict[str, tuple[int, dict[str, int]]]:
    """Our projection -> (its input size, its output rows per checkpoint part), from the config alone (compact
    weights replace the modules, not their shapes)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "self_attn.qkv_proj": (hidden, {"q_proj": q, "k_proj": kv, "v_proj": kv}),
        "self_attn.o_proj": (q, {"o_proj": hidden}),
        "mlp.gate_up_proj": (hidden, {"gate_proj": inner, "up_proj": inner}),
        "mlp.down_proj": (inner, {"down_proj": hidden}),
    }


def _stack(where: str, model: CausalLM, pairs: dict, rank: int, scaling: float) -> dict:
    """(layer, our module) -> (A, B) over every targeted part of that module, checked against the base's shapes."""
    layouts = _layouts(model.config)
    grouped: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for (layer, part), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {part} has lora_{'A' if 'B' in ab else 'B'} missing")
        ours = _PROJECTIONS[part]
        in_features, layout = layouts[ours]
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape != (rank, in_features) or b.shape != (layout[part], rank):
            raise ValueError(f"{where}: layer {layer} {part} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base "
                             f"model needs A ({rank}, {in_features}) and B ({layout[part]}, {rank})")
        grouped.setdefault((layer, ours), []).append((part, a, b))
    out = {}
    for (layer, ours), parts in grouped.items():
        layout = layouts[ours][1]
        a_all = torch.cat([a for _, a, _ in parts]).to(model.dtype)
        b_all = torch.zeros(sum(layout.values()), rank * len(parts), dtype=torch.float32)
        offsets = dict(zip(layout, _starts(layout.values()), strict=True))
        for i, (part, _, b) in enumerate(parts):
            b_all[offsets[part] : offsets[part] + layout[part], i * rank : (i + 1) * rank] = b.float() * scaling
        out[(layer, ours)] = (a_all.contiguous(), b_all.to(model.dtype))
    return out


def _starts(sizes) -> list[int]:
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


class LoraLayers:
    """Hooks on every decoder projection of ``model`` that add the step's adapters' low-rank products.

    ``set_batch([(start, end, adapter), ...])`` before a forward: each adapter's rows of the flattened batch, one
    contiguous range each (base rows are in no range); ``set_batch([])`` after. Only the engine thread calls it."""

    def __init__(self, model: CausalLM) -> None:
        self._segments: list[tuple[int, int, LoraAdapter]] = []
        for layer_index, layer in enumerate(model.model.layers):
            for ours in sorted(set(_PROJECTIONS.values())):
                module = layer.get_submodule(ours)
                module.register_forward_hook(self._hook(layer_index, ours))

    def set_batch(self, segments: list[tuple[int, int, LoraAdapter]]) -> None:
        self._segments = segments

    def _hook(self, layer: int, ours: str):
        key = (layer, ours)

        def add_low_rank(_module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            if not self._segments:
                return output
            x = inputs[0]
            for start, end, adapter in self._segments:
                ab = adapter.weights.get(key)
                if ab is not None:
                    a, b = ab
                    output[start:end].addmm_(x[start:end] @ a.t(), b.t())
            return output

        return add_low_rank

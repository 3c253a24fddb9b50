"""ModelConfig: the parts of a Hugging Face config.json (or of a GGUF file's metadata) that the Llama-family
decoder needs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from kvprefix.tokenizer.gguf_file import GGUFFile, is_gguf, open_gguf

# model_type -> the architecture name transformers writes; both spellings are accepted.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# GGUF general.architecture -> model_type. GGUF files of Llama 2/3, Mistral and SmolLM all say "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: None for full attention, else keys older than this many positions are not attended.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = _model_type(raw)
        hidden = raw["hidden_size"]
        heads = raw["num_attention_heads"]
        layers = raw["num_hidden_layers"]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; accepted: 'silu'")
        rope = _rope_parameters(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            # Qwen3 (and some Mistral variants) set head_dim independently of hidden_size / heads.
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_type=rope.get("rope_type", "default"),
            rope_parameters=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes bias on q/k/v only; Llama and Qwen3 use attention_bias for q/k/v/o.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type in ("qwen2", "mistral") else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows(raw, model_type, layers),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        """The config a GGUF file's metadata and tensor list imply (biases and norms: by the tensors present)."""
        arch = gguf.architecture
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{gguf.path}: unsupported architecture {arch!r}; accepted: {', '.join(GGUF_ARCHITECTURES)}"
            )
        heads, hidden = gguf.require(f"{arch}.attention.head_count"), gguf.require(f"{arch}.embedding_length")
        kv_heads = gguf.get(f"{arch}.attention.head_count_kv", heads)
        if not isinstance(heads, int) or not isinstance(kv_heads, int):
            raise ValueError(f"{gguf.path}: per-layer head counts are not supported")
        head_dim = gguf.get(f"{arch}.attention.key_length", hidden // heads)
        rope_dim = gguf.get(f"{arch}.rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise ValueError(f"{gguf.path}: partial rotary embedding ({rope_dim} of {head_dim} dims) is not supported")
        layers = gguf.require(f"{arch}.block_count")
        embedding = gguf.tensors.get("token_embd.weight")
        if embedding is None:
            raise ValueError(f"{gguf.path}: GGUF file has no token_embd.weight tensor")
        eos = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(
            model_type=GGUF_ARCHITECTURES[arch],
            vocab_size=int(embedding.shape[1]),  # GGUF shapes list the fastest-varying dimension first
            hidden_size=hidden,
            intermediate_size=gguf.require(f"{arch}.feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=gguf.get(f"{arch}.context_length", 4096),
            rms_norm_eps=float(gguf.require(f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_type=(rope := _gguf_rope(gguf, arch))["rope_type"],
            rope_parameters=rope,
            tie_word_embeddings="output.weight" not in gguf.tensors,
            qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
            o_bias="blk.0.attn_output.bias" in gguf.tensors,
            mlp_bias="blk.0.ffn_up.bias" in gguf.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
            sliding_windows=(None,) * layers,
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(int(i) for i in eos if i is not None),
        )

    @classmethod
    def from_path(cls, path: str) -> ModelConfig:
        if is_gguf(path):
            return cls.from_gguf(open_gguf(path))
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(
                f"no config.json in {path!r}; a checkpoint directory in Hugging Face format is expected"
            )
        with open(config_file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _model_type(raw: dict[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    by_arch = {arch: mt for mt, arch in SUPPORTED_MODEL_TYPES.items()}
    for arch in raw.get("architectures") or []:
        if arch in by_arch:
            return by_arch[arch]
    raise ValueError(
        f"unsupported model: model_type={model_type!r}, architectures={raw.get('architectures')!r}; "
        f"accepted model types: {sorted(SUPPORTED_MODEL_TYPES)} ({', '.join(SUPPORTED_MODEL_TYPES.values())})"
    )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Normalizes both config spellings: transformers>=5 `rope_parameters`, older `rope_theta` + `rope_scaling`."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    # Very old configs spell the key "type".
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; accepted: {list(SUPPORTED_ROPE_TYPES)}")
    rope["rope_type"] = rope_type
    return rope


def _gguf_rope(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    theta = float(gguf.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = gguf.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in gguf.tensors:
        # Llama 3.1+: the file carries the per-frequency divisors llama.cpp applies, instead of their recipe.
        if scaling != "none":
            raise ValueError(f"{gguf.path}: rope scaling {scaling!r} on top of rope_freqs is not supported")
        factors = gguf.tensors["rope_freqs.weight"].data
        return {"rope_type": "default", "rope_theta": theta, "freq_factors": [float(f) for f in factors]}
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(gguf.require(f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"{gguf.path}: unsupported rope scaling {scaling!r}; accepted: 'none', 'linear'")


def _sliding_windows(raw: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if raw.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in raw["layer_types"])
    if model_type == "mistral":
        return (window,) * layers
    if model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window") and window is not None:
        first = raw.get("max_window_layers", layers)
        return tuple(window if i >= first else None for i in range(layers))
    return (None,) * layers

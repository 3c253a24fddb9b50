"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3), with module names matching Hugging Face
checkpoints, except that q/k/v and gate/up are each one stacked projection (``MergedLinear``): one matmul instead of
three and two. ``CausalLM.checkpoint_views`` names every weight as the checkpoint does. Variants differ only in
flags carried by ModelConfig."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvprefix.model import native_decode, native_layer_ops, native_norm
from kvprefix.model.attention import AttentionMetadata, KVCache, LayerKV, paged_attention
from kvprefix.model.config import ModelConfig
from kvprefix.model.rope import RotaryEmbedding, apply_rotary_


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native_norm.supports(x, self.weight):  # one pass, the same roundings (docs/model.md#native-kernels)
            return native_norm.rms_norm(x, self.weight, self.eps)
        # The reference's rounding: normalize in float32, round to the model dtype, then scale. The fused kernel
        # without a weight equals the first step; in float32 the weight can join it.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, None, self.eps) * self.weight


class MergedLinear(nn.Linear):
    """Projections of the same input stacked along the output: ``parts`` maps each checkpoint module (a sibling
    name, e.g. "q_proj") to its rows, in order. Loading fills each part's rows (``CausalLM.checkpoint_views``)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias, dtype=dtype)
        self.parts = dict(parts)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.window = config.sliding_windows[layer]
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(hidden, parts, bias=config.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.qk_norm = config.qk_norm
        self.batch_invariant = False  # set by model.batch_invariant.make_batch_invariant

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: LayerKV,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q, k and v stay views of the one output: q and k are normed and rotated in place, as one tensor of heads,
        # and k and v go to the cache together, as one tensor of heads (the cache's layout).
        heads = qkv.view(tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, q, kv = heads[:, : self.num_heads + self.num_kv_heads], heads[:, : self.num_heads], heads[:, self.num_heads :]
        if self.qk_norm:
            k = qk[:, self.num_heads :]
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        apply_rotary_(qk, cos, sin)
        out = paged_attention(q, kv, kv_cache, meta, self.scale, self.window, self.batch_invariant)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.inner = inner
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inner, "up_proj": inner}, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if native_layer_ops.supports_silu_mul(gate_up):
            return self.down_proj(native_layer_ops.silu_mul(gate_up, self.inner))
        return self.down_proj(native_layer_ops.reference_silu_mul(gate_up, self.inner))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, meta, kv_cache) -> torch.Tensor:
        # Residuals added in place: x is this forward's own activation (the embedding lookup made a fresh tensor).
        x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        # Uninitialized: the checkpoint overwrites it, and normal_ on the meta device imports sympy (slow start-up).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """`model(input_ids, positions, meta, kv_caches)` -> hidden [T, hidden]; `compute_logits(hidden)` -> float32."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.name_or_path = ""  # the checkpoint directory, set by load_model
        self.model = DecoderModel(config, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """Every weight under its checkpoint (Hugging Face) name, a stacked projection split into its parts as
        views of their rows (a tied lm_head included): the loader copies into these, and a transformers model with
        this config loads them as its state dict."""
        views = {name: p.detach() for name, p in self.named_parameters(remove_duplicate=False)}
        for name, module in self.named_modules():
            if not isinstance(module, MergedLinear):
                continue
            parent = name.rpartition(".")[0]
            for kind in ("weight", "bias"):
                stacked = views.pop(f"{name}.{kind}", None)
                if stacked is None:
                    continue
                for part, rows in zip(module.parts, stacked.split(list(module.parts.values())), strict=True):
                    views[f"{parent}.{part}.{kind}"] = rows
        return views

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: KVCache
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        fused = native_decode.DecodeStep.of(meta, self.model.layers, kv_caches, x)
        if fused is not None:  # a decode-only step: every layer in one native call, the same bits
            fused.run(x, cos, sin)
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x = layer(x, cos, sin, meta, kv_cache)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

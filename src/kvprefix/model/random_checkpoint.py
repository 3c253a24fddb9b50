"""Random-weight checkpoints in real Hugging Face format (transformers' own classes write them), and random LoRA
adapters of them in the PEFT format (peft writes them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers

from kvprefix.tokenizer.builtin import END_OF_TEXT, IM_END, build_tokenizer

_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def write_random_checkpoint(
    path: str,
    arch: str = "llama",
    seed: int = 0,
    *,
    tokenizer_vocab_size: int = 512,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    **config: Any,
) -> str:
    """Writes config.json, generation_config.json, *.safetensors and tokenizer files to `path`; returns `path`.

    `config` overrides fields of the transformers config (hidden_size, num_hidden_layers, head_dim, rope_scaling,
    tie_word_embeddings, ...); the defaults are a tiny 2-layer model. The same arguments give the same bytes.
    `max_shard_size` splits the weights into shards with a model.safetensors.index.json.
    """
    if arch not in _CLASSES:
        raise ValueError(f"unsupported arch {arch!r}; accepted: {sorted(_CLASSES)}")
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[arch])
    tokenizer = build_tokenizer(tokenizer_vocab_size)
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)]
    fields = {**_TINY, "vocab_size": len(tokenizer), **config}
    # transformers' default init (std 0.02) leaves attention nearly uniform, so RoPE or masking bugs would hardly
    # move the logits; std 1/sqrt(hidden) gives attention scores of order 1.
    fields.setdefault("initializer_range", fields["hidden_size"] ** -0.5)
    hf_config = config_cls(eos_token_id=eos_ids[0], pad_token_id=eos_ids[1], bos_token_id=None, **fields)
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's random state
        torch.manual_seed(seed)
        model = model_cls(hf_config)
        _perturb_vectors(model)
    model.generation_config.eos_token_id = eos_ids
    model.to(dtype)
    os.makedirs(path, exist_ok=True)
    shard = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **shard)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def _perturb_vectors(model: torch.nn.Module) -> None:
    # transformers initializes norm weights to 1 and biases to 0; randomize them so that tests can tell a
    # missing norm or bias from a loaded one.
    for param in model.parameters():
        if param.ndim == 1:
            param.add_(torch.randn_like(param) * 0.1)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_lora_adapter(base_path: str, out_dir: str, *, rank: int = 8, seed: int = 0,
                              targets: tuple[str, ...] | list[str] = LORA_TARGETS, alpha: int | None = None,
                              scale: float = 0.2, gguf_file: str | None = None) -> str:
    """Saves a PEFT LoRA adapter of the checkpoint at ``base_path`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, written by peft itself, a test dependency) with random A and B of entries about
    ``scale`` (so it changes the outputs); returns ``out_dir``. ``gguf_file``: the base is that GGUF file in the
    directory ``base_path``."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, gguf_file=gguf_file)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets),
                             init_lora_weights=False, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    wrapped.save_pretrained(out_dir)
    return out_dir

"""Real PEFT LoRA adapters made at test time on a test checkpoint, and transformers + peft as the reference."""

from collections.abc import Sequence

import peft
import torch
import transformers

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(base_path: str, out_dir: str, *, rank: int = 8, seed: int = 0,
                       targets: Sequence[str] = ALL_TARGETS, alpha: int | None = None, scale: float = 0.2) -> str:
    """Saves a LoRA adapter of ``base_path`` (``adapter_config.json`` + ``adapter_model.safetensors``) with random A
    and B (so it changes the outputs), entries of size about ``scale``; returns ``out_dir``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
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


def peft_greedy(base_path: str, adapter_dir: str | None, prompts: Sequence[list[int]],
                max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt on the base checkpoint, with the adapter when given."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs

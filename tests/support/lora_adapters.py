"""transformers + peft as the reference for LoRA adapters (``kvprefix.model.write_random_lora_adapter`` makes
them at test time)."""

from collections.abc import Sequence

import peft
import torch
import transformers


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

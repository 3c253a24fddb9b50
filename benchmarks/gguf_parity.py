"""Parity of kvprefix's GGUF loading with transformers' own GGUF loading of the same file, and of its tokenizer
with llama.cpp's rules (the reference in tests/tokenizer/llama_cpp_bpe.py) and with transformers' GGUF tokenizer.

Weights: every parameter against transformers' dequantized, un-permuted tensor. Greedy: chat prompts through
kvprefix's LLM and through transformers' LlamaForCausalLM.generate on the same token ids, float32 and bfloat16.
A one-off check: it uses transformers' GGUF code, which kvprefix itself never imports.

    python benchmarks/gguf_parity.py [--model FILE.gguf] [--max-tokens 32] [--out results/gguf_parity.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvprefix import LLM, SamplingParams
from kvprefix.model import default_model_path, load_model
from kvprefix.tokenizer import Tokenizer
from kvprefix.tokenizer.gguf_file import open_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' support package
from support.llama_cpp_bpe import PARITY_STRINGS, encode  # noqa: E402

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain in one sentence what a cache is.",
)


def transformers_model(path: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    raw = load_gguf_checkpoint(path)["config"]
    config = LlamaConfig(**{k: v for k, v in raw.items() if not k.startswith("_")})
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.to(dtype).eval(), tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the built-in default model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="results/gguf_parity.json")
    args = parser.parse_args()
    path = args.model or default_model_path()
    result: dict = {"model": path}

    gguf = open_gguf(path)
    tokens, merges = gguf.require("tokenizer.ggml.tokens"), gguf.require("tokenizer.ggml.merges")
    types = gguf.require("tokenizer.ggml.token_type")
    specials = [t for t, k in zip(tokens, types, strict=True) if k in (3, 4)]
    pre = gguf.require("tokenizer.ggml.pre")
    ours = Tokenizer(path)
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    ref = [encode(s, tokens, merges, pre, specials) for s in PARITY_STRINGS]
    mine = [ours.encode(s, add_special_tokens=False) for s in PARITY_STRINGS]
    hf = [theirs.encode(s, add_special_tokens=False) for s in PARITY_STRINGS]
    result["tokenizer"] = {
        "strings": len(PARITY_STRINGS),
        "kvprefix_equal_llama_cpp_rules": sum(a == b for a, b in zip(mine, ref, strict=True)),
        "transformers_equal_llama_cpp_rules": sum(a == b for a, b in zip(hf, ref, strict=True)),
        "transformers_differs_on": [s for s, a, b in zip(PARITY_STRINGS, hf, ref, strict=True) if a != b],
    }
    print(json.dumps(result["tokenizer"], indent=1, ensure_ascii=False))

    hf_model, tensors = transformers_model(path, torch.float32)
    mine_model = load_model(path, torch.float32)
    diffs = {name: (p - tensors[name].float()).abs().max().item() for name, p in mine_model.checkpoint_views().items()
             if name in tensors}
    result["weights"] = {"compared": len(diffs), "max_abs_diff": max(diffs.values())}
    print(result["weights"])
    del mine_model

    result["greedy"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        llm = LLM(path, dtype=name, num_gpu_blocks=256)
        model = hf_model.to(dtype)
        same = 0
        rows = []
        for q in QUESTIONS:
            ids = ours.apply_chat_template([{"role": "user", "content": q}])
            out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=args.max_tokens))
            got = out[0].outputs[0].token_ids
            with torch.inference_mode():
                ref_ids = model.generate(torch.tensor([ids]), max_new_tokens=len(got), do_sample=False)[0, len(ids):]
            same += got == ref_ids.tolist()
            rows.append({"question": q, "kvprefix": ours.decode(got), "transformers": ours.decode(ref_ids.tolist())})
        result["greedy"][name] = {"identical": same, "prompts": len(QUESTIONS), "outputs": rows}
        print(name, f"{same}/{len(QUESTIONS)} identical greedy outputs")
        for r in rows:
            print("  ", r["question"], "->", repr(r["kvprefix"]))
        del llm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()

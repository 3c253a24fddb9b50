"""How far each way of computing the built-in model moves its next-token distributions from the file dequantized
in float32: teacher-forced over chat prompts and the float32 model's own greedy continuations (so every variant
sees the same tokens), mean KL(float32 || variant), top-1 agreement and mean |log p| difference of the
continuation's tokens.

Variants: ``bfloat16`` (the file dequantized, bfloat16), ``gguf`` (``--quantization gguf`` as this tree runs it),
``gguf weight-only`` (the same without int8 activations: the lm_head on the weight-only op), and on the float32
model with fake quantization (values rounded in float32, to isolate each effect): ``w8`` (projection weights
re-quantized to int8 per output channel), ``a8 row`` (each projection's input rounded to 255 levels of its row's
max: one int8 pass), ``a8 g32`` (rounded per group of 32 inputs, llama.cpp's Q8 blocks), ``w8 a8 row``.

    python benchmarks/bench_quant_error.py [--prompts 12] [--tokens 64] [--variants ...]
        [--out results/bench_quant_error.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_agreement import conversations, prompt_ids
from harness import dense_quantization, write_results

from kvprefix.cache.default_model import default_model_path
from kvprefix.engine import LLM, SamplingParams
from kvprefix.model import AttentionMetadata, allocate_kv_cache, load_model
from kvprefix.model import quantized_linear as ql

VARIANTS = ("bfloat16", "gguf", "gguf weight-only", "w8", "a8 row", "a8 g32", "w8 a8 row")
BLOCK = 16


def log_probs(model, seq: list[int]) -> torch.Tensor:
    """float32 log-softmax of every position's logits, one prefill of ``seq``."""
    blocks = -(-len(seq) // BLOCK)
    kv = allocate_kv_cache(model.config, blocks, BLOCK, model.dtype, "cpu")
    meta, positions = AttentionMetadata.for_chunks([(0, len(seq), list(range(blocks)))], BLOCK)
    return model.compute_logits(model(torch.tensor(seq), positions, meta, kv)).float().log_softmax(-1)


def round_rows(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x rounded to 255 levels of each row's (or each ``group`` of a row's) max|x|: an int8 pass, in float."""
    g = x if group is None else x.reshape(*x.shape[:-1], -1, group)
    step = g.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return (torch.round(g / step) * step).reshape(x.shape)


def build(variant: str):
    path = default_model_path()
    if variant in ("gguf", "gguf weight-only"):
        saved = ql.INT8_ACTIVATIONS
        ql.INT8_ACTIVATIONS = saved and variant == "gguf"  # the layers read it when they are built
        try:
            return ql.quantize_model(load_model(path, torch.bfloat16), "gguf", path)
        finally:
            ql.INT8_ACTIVATIONS = saved
    if variant == "bfloat16":
        return load_model(path, torch.bfloat16)
    model = load_model(path, torch.float32)
    projections = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]
    with torch.no_grad():
        for p in projections:
            if "w8" in variant:
                q, scales = ql.int8_from_float(p.weight)
                p.weight.copy_(q.float() * scales[:, None])
            if "a8" in variant:
                group = 32 if "g32" in variant else None
                p.register_forward_pre_hook(lambda _m, args, group=group: (round_rows(args[0], group),))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/bench_quant_error.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    prompts = prompt_ids(conversations(args.prompts))
    llm = LLM(dtype="float32", quantization=dense_quantization(), kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    with torch.inference_mode():
        ref = [log_probs(llm.llm_engine.runner.model, s) for s in seqs]
    del llm
    rows = []
    for name in names:
        model = build(name)
        kl, top1, dlogp = [], [], []
        with torch.inference_mode():
            for prompt, seq, r in zip(prompts, seqs, ref, strict=True):
                got = log_probs(model, seq)
                n = len(prompt)
                rr, gg = r[n - 1 : -1], got[n - 1 : -1]  # the positions that predict the continuation
                target = torch.tensor(seq[n:])[:, None]
                kl.append(float((rr.exp() * (rr - gg)).sum(-1).mean()))
                top1.append(float((rr.argmax(-1) == gg.argmax(-1)).float().mean()))
                dlogp.append(float((gg.gather(1, target) - rr.gather(1, target)).abs().mean()))
        rows.append({"variant": name, "KL": statistics.mean(kl), "top-1 agreement": statistics.mean(top1),
                     "mean |dlogprob|": statistics.mean(dlogp)})
        print(rows[-1], flush=True)
    write_results(args.out, {"config": vars(args), "rows": rows}, rows,
                  formats={"KL": ".4f", "top-1 agreement": ".3f", "mean |dlogprob|": ".4f"})


if __name__ == "__main__":
    main()

"""How far prefill attention's ways are from exact on the built-in model's own activations: every layer's native,
tiled and flash-kernel outputs (``bench_attention``'s ways; native where this CPU has it) against float64 attention
over the same bfloat16 inputs.

The model (bfloat16) prefills ``context`` tokens of this repository's docs, then a chunk of ``new`` more; each
layer's queries and cache for that chunk are captured and attended each way. Reports the relative error (norm of
the difference over the norm of the exact output) per way: mean and worst over the layers.

    python benchmarks/bench_attention_error.py [--context 2048] [--new 1024] [--out results/bench_attention_error.json]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from bench_attention import _run
from harness import cpu_name, write_results

import kvprefix.model.llama as llama
from kvprefix.cache.default_model import default_model_path
from kvprefix.model import AttentionMetadata, allocate_kv_cache, load_model, native_prefill
from kvprefix.sim.openai_bodies import load_tokenizer

BLOCK_SIZE = 16


def exact(q: torch.Tensor, context: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64 of q [new, heads, dim] (the last ``new`` positions) over the context's K and V
    [seq, 2 * kv_heads, dim]."""
    new, heads, _ = q.shape
    kv_heads = context.shape[1] // 2
    keys, values = (x.double().repeat_interleave(heads // kv_heads, 1) for x in context.split(kv_heads, 1))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    seq = context.shape[0]
    scores.masked_fill_(torch.arange(seq)[None, :] > torch.arange(seq - new, seq)[:, None], -torch.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--out", default="results/bench_attention_error.json")
    args = parser.parse_args()
    path = default_model_path()
    docs = sorted(Path(__file__).resolve().parent.parent.joinpath("docs").glob("*.md"))
    ids = load_tokenizer(path).encode("".join(p.read_text(encoding="utf-8") for p in docs))
    total = args.context + args.new
    if len(ids) < total:
        parser.error(f"the docs hold {len(ids)} tokens, fewer than {total}")
    model = load_model(path, dtype=torch.bfloat16)
    blocks = list(range(-(-total // BLOCK_SIZE)))
    cache = allocate_kv_cache(model.config, len(blocks), BLOCK_SIZE, torch.bfloat16, "cpu")
    captured = []
    inner = llama.paged_attention

    def capture(q, kv, layer_cache, meta, scale, *rest):
        captured.append((q.clone(), kv.clone(), layer_cache.kv.clone(), scale))
        return inner(q, kv, layer_cache, meta, scale, *rest)

    for start, n in ((0, args.context), (args.context, args.new)):
        meta, positions = AttentionMetadata.for_chunks([(start, n, blocks)], BLOCK_SIZE)
        llama.paged_attention = capture if start else inner
        model(torch.tensor(ids[start : start + n]), positions, meta, cache)
    llama.paged_attention = inner
    errors = {way: [] for way in ("native", "tiled", "flash") if way != "native" or native_prefill.kernel()}
    with torch.inference_mode():
        for q, kv, layer_kv, scale in captured:
            context = layer_kv.flatten(0, 1).clone()
            context[args.context : total] = kv  # what the chunk's own write puts there
            truth = exact(q, context[:total], scale)
            for way, found in errors.items():
                layer_cache = llama.LayerKV(layer_kv.clone())
                meta, _ = AttentionMetadata.for_chunks([(args.context, args.new, blocks)], BLOCK_SIZE)
                out = _run((q, kv, layer_cache, meta), way, scale)[1].double()
                found.append(((out - truth).norm() / truth.norm()).item())
    rows = [{"way": way, "mean relative error": statistics.mean(e), "worst layer": max(e)} for way, e in errors.items()]
    write_results(args.out, {"cpu": cpu_name(), "context": args.context, "new": args.new, "rows": rows,
                             "per_layer": errors}, rows,
                  formats={"mean relative error": ".2e", "worst layer": ".2e"})


if __name__ == "__main__":
    main()

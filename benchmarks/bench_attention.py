"""Prefill attention on CPU, four ways through ``paged_attention`` on the built-in model's head shapes,
interleaved: the native kernel (``native``, ``kernels/prefill_attention.c``; where this CPU has AVX512-BF16),
query tiles of plain matmuls (``tiled``), PyTorch's flash kernel (``flash``: after earlier context two unmasked
calls merged by log-sum-exp, a cold chunk one causal call), and one flash call with an explicit mask (``masked``;
a cold chunk takes the causal call here too).

Each case is a chunk of ``new`` tokens after ``context`` tokens already in a paged cache (one layer, the model's
heads); a round times each way once, in alternating order, each way forced on whatever the size thresholds
(``TILED_MIN_NEW``, ``TILED_MIN_KEYS``, ``SPLIT_MIN_NEW``) would pick, to show where they belong. The native and
tiled ways are bfloat16's only (in float32 both time the flash kernel). Reports medians, their ratios and the
largest differences between the native, tiled and flash outputs.

    python benchmarks/bench_attention.py [--rounds 7] [--threads 1] [--dtypes bfloat16]
        [--cases 2048+2048,4064+1024,...] [--out results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from harness import cpu_name, write_results

from kvprefix.cache.default_model import default_model_path
from kvprefix.model import attention, native_prefill
from kvprefix.model.attention import AttentionMetadata, allocate_kv_cache, paged_attention
from kvprefix.model.config import ModelConfig

BLOCK_SIZE = 16
CASES = "64+16,1024+128,1024+256,2048+256,0+512,0+2048,2048+512,2048+2048,4064+1024,4064+2048,6112+2048"


def _case(config: ModelConfig, context: int, new: int, dtype: torch.dtype, seed: int):
    """One layer's paged cache holding ``context`` tokens, and a chunk of ``new`` after them."""
    gen = torch.Generator().manual_seed(seed)
    total = context + new
    blocks = -(-total // BLOCK_SIZE)
    cache = allocate_kv_cache(config, blocks, BLOCK_SIZE, dtype, "cpu")[0]
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    earlier = torch.randn(context, 2 * kv_heads, dim, generator=gen).to(dtype)
    cache.kv.view(-1, 2 * kv_heads, dim)[:context] = earlier
    meta, _ = AttentionMetadata.for_chunks([(context, new, list(range(blocks)))], BLOCK_SIZE)
    q = torch.randn(new, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(new, 2 * kv_heads, dim, generator=gen).to(dtype)
    return q, kv, cache, meta


NEVER = 1 << 30
WAYS = {  # the thresholds that force each way on (all but ``native`` with the native kernel off)
    "native": {},
    "tiled": {"TILED_MIN_NEW": 1, "TILED_MIN_KEYS": 1},
    "flash": {"TILED_MIN_NEW": NEVER, "SPLIT_MIN_NEW": 1},
    "masked": {"TILED_MIN_NEW": NEVER, "SPLIT_MIN_NEW": NEVER},
}


def _run(case, way: str, scale: float) -> tuple[float, torch.Tensor]:
    """One call, ``way`` forced on; the step's mask is cached in ``meta`` after the first call, as the engine
    shares it across layers."""
    q, kv, cache, meta = case
    defaults = {name: getattr(attention, name) for name in WAYS[way]}
    for name, value in WAYS[way].items():
        setattr(attention, name, value)
    native = native_prefill.supports
    if way != "native":
        native_prefill.supports = lambda query: False
    try:
        start = time.perf_counter()
        out = paged_attention(q, kv, cache, meta, scale)
        return time.perf_counter() - start, out
    finally:
        native_prefill.supports = native
        for name, value in defaults.items():
            setattr(attention, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--cases", default=CASES, help="context+new tokens, comma-separated")
    parser.add_argument("--out", default="results/bench_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_path(default_model_path())
    scale = config.head_dim ** -0.5
    print(f"CPU: {cpu_name()}, {args.threads} thread(s); heads {config.num_attention_heads}, KV heads "
          f"{config.num_key_value_heads}, head dim {config.head_dim}; load average {os.getloadavg()[0]:.1f}")
    ways = [way for way in WAYS if way != "native" or native_prefill.kernel() is not None]
    if "native" not in ways:
        print("no native prefill kernel here (it needs AVX512-BF16): its way is left out")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for i, spec in enumerate(args.cases.split(",")):
            context, new = (int(x) for x in spec.split("+"))
            case = _case(config, context, new, dtype, seed=i)
            times = {way: [] for way in ways}
            for r in range(args.rounds + 1):  # the first round warms up and is dropped
                for way in (ways if r % 2 else ways[::-1]):
                    seconds, _ = _run(case, way, scale)
                    if r:
                        times[way].append(seconds)
            flash = _run(case, "flash", scale)[1].float()
            ms = {way: statistics.median(times[way]) * 1e3 for way in ways}
            flops = 4 * config.head_dim * config.num_attention_heads * (new * context + new * (new + 1) // 2)
            row = {"dtype": dtype_name, "context": context, "new": new, **{f"{way} ms": ms[way] for way in ways}}
            for way in ways[: ways.index("flash")]:  # the ways of ours, against the flash kernel
                row[f"{way} / flash"] = ms[way] / ms["flash"]
                row[f"{way} max abs diff"] = (_run(case, way, scale)[1].float() - flash).abs().max().item()
            row["flash / masked"] = ms["flash"] / ms["masked"]
            row.update({f"{way} GFLOP/s": flops / ms[way] / 1e6 for way in ways[:-1]})
            rows.append(row)
            print(f"  {dtype_name} {context}+{new}: " + ", ".join(f"{w} {ms[w]:.2f} ms" for w in ways), flush=True)
    formats = {f"{way} ms": ".2f" for way in ways} | {"flash / masked": ".2f"}
    for way in ways:
        formats |= {f"{way} / flash": ".2f", f"{way} GFLOP/s": ".0f", f"{way} max abs diff": ".1e"}
    write_results(args.out, {"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds,
                             "load_average": os.getloadavg()[0], "rows": rows}, rows, formats=formats)

if __name__ == "__main__":
    main()

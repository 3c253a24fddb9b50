"""Prefill attention after earlier context: the two unmasked flash calls merged by log-sum-exp against one call
with an explicit mask, through ``paged_attention`` on the built-in model's head shapes, interleaved.

Each case is a chunk of ``new`` tokens after ``context`` tokens already in a paged cache (one layer, the model's
heads); a round times each way once, in alternating order (the masked call is what ``SPLIT_MIN_NEW`` above the
chunk selects; the split is forced on for chunks below it too, to show why it is the threshold). Reports medians, their ratio and the largest difference between the two outputs.

    python benchmarks/bench_attention.py [--rounds 7] [--threads 1] [--dtypes bfloat16,float32]
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
from kvprefix.model import attention
from kvprefix.model.attention import AttentionMetadata, allocate_kv_cache, paged_attention
from kvprefix.model.config import ModelConfig

BLOCK_SIZE = 16
CASES = "64+16,1024+128,1024+256,2048+256,2048+2048,4064+1024,4064+4096"  # context+new


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


def _run(case, split: bool, scale: float) -> tuple[float, torch.Tensor]:
    """One call, the two-call split forced on or off; the step's mask is cached in ``meta`` after the first call,
    as the engine shares it across layers."""
    q, kv, cache, meta = case
    default = attention.SPLIT_MIN_NEW
    attention.SPLIT_MIN_NEW = 1 if split else 1 << 30
    try:
        start = time.perf_counter()
        out = paged_attention(q, kv, cache, meta, scale)
        return time.perf_counter() - start, out
    finally:
        attention.SPLIT_MIN_NEW = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--cases", default=CASES, help="context+new tokens, comma-separated")
    parser.add_argument("--out", default="results/bench_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_path(default_model_path())
    scale = config.head_dim ** -0.5
    print(f"CPU: {cpu_name()}, {args.threads} thread(s); heads {config.num_attention_heads}, KV heads "
          f"{config.num_key_value_heads}, head dim {config.head_dim}; load average {os.getloadavg()[0]:.1f}")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for i, spec in enumerate(args.cases.split(",")):
            context, new = (int(x) for x in spec.split("+"))
            case = _case(config, context, new, dtype, seed=i)
            times = {True: [], False: []}
            for r in range(args.rounds + 1):  # the first round warms up and is dropped
                for split in ((True, False) if r % 2 else (False, True)):
                    seconds, _ = _run(case, split, scale)
                    if r:
                        times[split].append(seconds)
            diff = (_run(case, True, scale)[1].float() - _run(case, False, scale)[1].float()).abs().max().item()
            split_ms, masked_ms = (statistics.median(times[s]) * 1e3 for s in (True, False))
            rows.append({"dtype": dtype_name, "context": context, "new": new, "masked ms": masked_ms,
                         "split ms": split_ms, "split / masked": split_ms / masked_ms, "max abs diff": diff})
            print(f"  {dtype_name} {context}+{new}: masked {masked_ms:.2f} ms, split {split_ms:.2f} ms", flush=True)
    write_results(args.out, {"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds, "rows": rows},
                  rows, formats={"masked ms": ".2f", "split ms": ".2f", "split / masked": ".2f",
                                 "max abs diff": ".1e"})


if __name__ == "__main__":
    main()

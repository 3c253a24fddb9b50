"""The native decode attention (``kernels/decode_attention.c``) against the PyTorch path it replaces (the engine's
gather of the blocks and masked attention), on the built-in model's heads, bfloat16, 64-4,000 positions and 1-8
decodes with blocks of their own, a model's layers a step; the two interleaved in one run, medians reported.

    python benchmarks/bench_native_kernels.py [--rounds 5] [--threads 1] [--contexts 64,256,1000,4000]
        [--decodes 1,8] [--out results/bench_native_kernels.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from harness import cpu_name, write_results

from kvprefix.cache.default_model import default_model_path
from kvprefix.model import AttentionMetadata, attention, native_attention
from kvprefix.model.config import ModelConfig


def seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


@contextlib.contextmanager
def without_native_attention():
    saved = native_attention.supports
    native_attention.supports = lambda q, cache: False
    try:
        yield
    finally:
        native_attention.supports = saved


def attention_cases(config: ModelConfig, contexts: list[int], decodes_options: list[int]) -> list[dict]:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim, block = config.head_dim, 16
    cases = []
    for context in contexts:
        for decodes in decodes_options:
            blocks = decodes * -(-context // block)
            gen = torch.Generator().manual_seed(context + decodes)
            cache = torch.randn(blocks + 1, block, 2 * kv_heads, dim, generator=gen).bfloat16()
            order = torch.randperm(blocks, generator=gen).view(decodes, -1).tolist()  # each its own blocks
            q = torch.randn(decodes, heads, dim, generator=gen).bfloat16()
            chunks = [(context - 1, 1, table) for table in order]
            meta = AttentionMetadata.for_chunks(chunks, block)[0]
            plan = meta.plan(block)

            def run(q=q, cache=cache, plan=plan) -> None:
                for _ in range(config.num_hidden_layers):
                    attention._decode(q, cache, plan, dim**-0.5, None)

            def pytorch(run=run) -> None:
                with without_native_attention():
                    run()

            cases.append({"positions": context, "decodes": decodes,
                          "bytes": decodes * context * 2 * kv_heads * dim * 2, "native": run, "pytorch": pytorch})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two sides; medians reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="64,256,1000,4000", help="positions per decode")
    parser.add_argument("--decodes", default="1,8", help="decodes per call")
    parser.add_argument("--out", default="results/bench_native_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native_attention.kernel() is None:
        raise SystemExit("the native kernel is not built here (a C compiler?): nothing to compare")
    config = ModelConfig.from_path(default_model_path())
    cases = attention_cases(config, [int(c) for c in args.contexts.split(",")],
                            [int(d) for d in args.decodes.split(",")])
    rows = []
    for i, case in enumerate(cases):
        times: dict[str, list[float]] = {"native": [], "pytorch": []}
        for side in ("native", "pytorch"):
            case[side]()  # warm
        for _ in range(args.rounds):
            for side in ("native", "pytorch"):
                times[side].append(seconds(case[side], 3) / config.num_hidden_layers)
        native, pytorch = (statistics.median(times[s]) for s in ("native", "pytorch"))
        rows.append({"positions": case["positions"], "decodes": case["decodes"], "native us": native * 1e6,
                     "pytorch us": pytorch * 1e6, "ratio": native / pytorch, "native GB/s": case["bytes"] / native / 1e9})
        print(f"[{i + 1}/{len(cases)}] {case['positions']} positions x {case['decodes']}: {rows[-1]['ratio']:.2f}x",
              flush=True)
    write_results(args.out, {"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds, "rows": rows}, rows,
                  formats={"native us": ".1f", "pytorch us": ".1f", "ratio": ".2f", "native GB/s": ".1f"})
    print(f"CPU: {cpu_name()}, {args.threads} thread(s); microseconds a layer; ratio = native / PyTorch time "
          "(below 1: the kernel faster); GB/s: the K and V read")


if __name__ == "__main__":
    main()

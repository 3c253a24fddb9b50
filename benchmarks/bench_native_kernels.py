"""The native kernels against the PyTorch paths they replace, on the built-in model's shapes, interleaved in one
run, medians reported:

- decode attention (``kernels/decode_attention.c`` against the engine's gather of the blocks and masked attention):
  time a layer, bfloat16, 64-4,000 positions, 1-8 decodes with blocks of their own; and the error of both against
  float64 attention at 1,000 positions, bfloat16 and float32;
- RMSNorm (``kernels/rms_norm.c`` against PyTorch's ops, the model's ``RMSNorm`` module either way): time a call,
  bfloat16, 1 and 1,024 rows; and the share of elements whose bfloat16 result differs.

    python benchmarks/bench_native_kernels.py [--rounds 5] [--threads 1] [--contexts 64,256,1000,4000]
        [--decodes 1,8] [--out results/bench_native_kernels.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from harness import cpu_name, table, write_results

from kvprefix.cache.default_model import default_model_path
from kvprefix.model import AttentionMetadata, attention, native_attention, native_norm
from kvprefix.model.config import ModelConfig
from kvprefix.model.llama import RMSNorm


def seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


@contextlib.contextmanager
def without(module):
    """``module``'s kernel unused meanwhile (its ``supports`` says no): PyTorch's path."""
    saved = module.supports
    module.supports = lambda *args: False
    try:
        yield
    finally:
        module.supports = saved


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
                with without(native_attention):
                    run()

            cases.append({"positions": context, "decodes": decodes,
                          "bytes": decodes * context * 2 * kv_heads * dim * 2, "native": run, "pytorch": pytorch})
    return cases


def attention_errors(config: ModelConfig, context: int = 1000) -> list[dict]:
    """Relative error (norm) of each path against float64 attention, one decode at ``context`` positions."""
    heads, kv_heads, dim, block = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 16
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(context)
        blocks = -(-context // block)
        cache = torch.randn(blocks, block, 2 * kv_heads, dim, generator=gen).to(dtype)
        q = torch.randn(1, heads, dim, generator=gen).to(dtype)
        table = torch.randperm(blocks, generator=gen)[None]
        meta = AttentionMetadata.for_chunks([(context - 1, 1, table[0].tolist())], block)[0]
        lens = torch.tensor([context])
        exact = native_attention.reference_attention(q, cache, table, lens, dim**-0.5)
        native = native_attention.decode_attention(q, cache, table, lens, dim**-0.5)  # float32 too, called directly
        with without(native_attention):
            pytorch = attention._decode(q, cache, meta.plan(block), dim**-0.5, None)
        row = {"dtype": str(dtype).removeprefix("torch."), "positions": context}
        for side, out in (("native", native), ("pytorch", pytorch)):
            row[f"{side} error"] = float((out.double() - exact).norm() / exact.norm())
        rows.append(row)
    return rows


def norm_rows(config: ModelConfig, rounds: int) -> list[dict]:
    """The model's RMSNorm module with and without the kernel: time a call, and how many bfloat16 results differ."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps, torch.bfloat16)
    norm.weight.data = (torch.rand(config.hidden_size, generator=gen) * 2).bfloat16()
    rows = []
    for tokens in (1, 1024):
        x = (torch.randn(tokens, config.hidden_size, generator=gen) * 3).bfloat16()
        calls = 2000 if tokens == 1 else 50
        times: dict[str, list[float]] = {"native": [], "pytorch": []}
        for _ in range(rounds):
            times["native"].append(seconds(lambda x=x: norm(x), calls))
            with without(native_norm):
                times["pytorch"].append(seconds(lambda x=x: norm(x), calls))
        native, pytorch = (statistics.median(times[s]) for s in ("native", "pytorch"))
        with without(native_norm):
            expected = norm(x)
        rows.append({"rows": tokens, "native us": native * 1e6, "pytorch us": pytorch * 1e6, "ratio": native / pytorch,
                     "elements differing": f"{int((norm(x) != expected).sum())} of {x.numel()}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two sides; medians reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="64,256,1000,4000", help="positions per decode")
    parser.add_argument("--decodes", default="1,8", help="decodes per call")
    parser.add_argument("--out", default="results/bench_native_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native_attention.kernel() is None or native_norm.kernel() is None:
        raise SystemExit("the native kernels are not built here (a C compiler?): nothing to compare")
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
                     "pytorch us": pytorch * 1e6, "ratio": native / pytorch,
                     "native GB/s": case["bytes"] / native / 1e9})
        print(f"[{i + 1}/{len(cases)}] {case['positions']} positions x {case['decodes']}: {rows[-1]['ratio']:.2f}x",
              flush=True)
    errors, norms = attention_errors(config), norm_rows(config, args.rounds)
    print("decode attention against float64, relative error (norm):")
    print(table(errors, formats={"native error": ".2e", "pytorch error": ".2e"}))
    print("\nRMSNorm, microseconds a call (the model's module):")
    print(table(norms, formats={"native us": ".1f", "pytorch us": ".1f", "ratio": ".2f"}))
    print("\ndecode attention: microseconds a layer; ratio = native / PyTorch time (below 1: the kernel faster); "
          "GB/s: the K and V read")
    write_results(args.out, {"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds, "attention": rows,
                             "attention_errors": errors, "rms_norm": norms}, rows,
                  formats={"native us": ".1f", "pytorch us": ".1f", "ratio": ".2f", "native GB/s": ".1f"})
    print(f"CPU: {cpu_name()}, {args.threads} thread(s)")


if __name__ == "__main__":
    main()

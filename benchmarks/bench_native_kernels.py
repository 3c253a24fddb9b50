"""The native kernels against the PyTorch ops they replace, on the built-in model's shapes, interleaved in one run.

- int4 projections (``kernels/q4_q8.c`` against ``aten._weight_int4pack_mm_for_cpu``) at 1-16 rows, the weights
  of a whole model's 30 layers cycled (streamed from memory, as a decode step reads them) and one layer's repeated
  (in cache);
- decode attention (``kernels/decode_attention.c`` against PyTorch's gather and masked attention, the engine's
  path without the kernel) at 64-4,000 positions, 1-8 decodes, bfloat16.

    python benchmarks/bench_native_kernels.py [--rounds 5] [--threads 1] [--out results/bench_native_kernels.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from harness import cpu_name, write_results

from kvprefix.cache.default_model import default_model_path
from kvprefix.model import AttentionMetadata, attention, int4_q8, native_attention
from kvprefix.model.config import ModelConfig

LAYERS = 30


def seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def int4_cases(config: ModelConfig, rows_options: list[int]) -> list[dict]:
    h, inner, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_width, kv_width = config.num_attention_heads * dim, config.num_key_value_heads * dim
    shapes = {"qkv": (q_width + 2 * kv_width, h), "o": (h, q_width), "gate_up": (2 * inner, h), "down": (h, inner)}
    cases = []
    for name, (n, k) in shapes.items():
        gen = torch.Generator().manual_seed(n + k)
        layers = []
        for _ in range(LAYERS):
            q = torch.randint(0, 16, (n, k), generator=gen)
            scales, zeros = torch.rand(n, k // 32, generator=gen) / 8, torch.randn(n, k // 32, generator=gen) / 8
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            pairs = torch.stack([scales.t(), zeros.t()], -1).bfloat16().contiguous()
            layers.append((int4_q8.pack(q, scales, zeros), packed, pairs))
        for rows in rows_options:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            for where, used in (("streamed", layers), ("in cache", layers[:1] * LAYERS)):
                cases.append({"kernel": "int4", "shape": f"{name} {n}x{k}", "rows": rows, "weights": where,
                              "bytes": n * k * 20 // 32,
                              "native": lambda x=x, used=used: [int4_q8.matmul(x, *w) for w, _, _ in used],
                              "pytorch": lambda x=x, used=used: [
                                  torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz) for _, p, sz in used]})
    return cases


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
                for _ in range(LAYERS):
                    attention._decode(q, cache, plan, dim**-0.5, None)

            def pytorch(run=run) -> None:
                with without_native_attention():
                    run()

            cases.append({"kernel": "decode attention", "shape": f"{context} positions", "rows": decodes,
                          "weights": "", "bytes": decodes * context * 2 * kv_heads * dim * 2,
                          "native": run, "pytorch": pytorch})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two sides; medians reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,8,16", help="int4: rows per call")
    parser.add_argument("--contexts", default="64,256,1000,4000", help="attention: positions per decode")
    parser.add_argument("--decodes", default="1,8", help="attention: decodes per call")
    parser.add_argument("--out", default="results/bench_native_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if int4_q8.kernel() is None or native_attention.kernel() is None:
        raise SystemExit("the native kernels are not built here (a C compiler?): nothing to compare")
    config = ModelConfig.from_path(default_model_path())
    cases = int4_cases(config, [int(r) for r in args.rows.split(",")])
    cases += attention_cases(config, [int(c) for c in args.contexts.split(",")],
                             [int(d) for d in args.decodes.split(",")])
    rows = []
    for i, case in enumerate(cases):
        times: dict[str, list[float]] = {"native": [], "pytorch": []}
        for side in ("native", "pytorch"):
            case[side]()  # warm
        for _ in range(args.rounds):
            for side in ("native", "pytorch"):
                times[side].append(seconds(case[side], 3) / LAYERS)
        native, pytorch = (statistics.median(times[s]) for s in ("native", "pytorch"))
        rows.append({k: case[k] for k in ("kernel", "shape", "rows", "weights")}
                    | {"native us": native * 1e6, "pytorch us": pytorch * 1e6, "ratio": native / pytorch,
                       "native GB/s": case["bytes"] / native / 1e9})
        print(f"[{i + 1}/{len(cases)}] {rows[-1]['kernel']} {rows[-1]['shape']} x{rows[-1]['rows']}: "
              f"{rows[-1]['ratio']:.2f}x", flush=True)
    write_results(args.out, {"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds, "rows": rows}, rows,
                  formats={"native us": ".1f", "pytorch us": ".1f", "ratio": ".2f", "native GB/s": ".1f"})
    print(f"CPU: {cpu_name()}, {args.threads} thread(s); ratio = native / PyTorch time (below 1: the kernel faster)")


if __name__ == "__main__":
    main()

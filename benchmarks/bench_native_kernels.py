"""The native kernels against the PyTorch paths they replace, on the built-in model's shapes, interleaved in one
run, medians reported:

- decode attention (``kernels/decode_attention.c`` against the engine's gather of the blocks and masked attention):
  time a layer, bfloat16, 64-4,000 positions, 1-8 decodes with blocks of their own; and the error of both against
  float64 attention at 1,000 positions, bfloat16 and float32;
- RMSNorm (``kernels/rms_norm.c`` against PyTorch's ops, the model's ``RMSNorm`` module either way): time a call,
  bfloat16, 1 and 1,024 rows; and the share of elements whose bfloat16 result differs;
- rotary and SiLU-and-multiply (``kernels/layer_ops.c`` against PyTorch's ops): time a call on the model's q and
  k heads / gate_up rows, 1 to 1,024 rows; and the share of bfloat16 results that differ;
- the int4 matmul (``kernels/int4_matmul.c`` against PyTorch's int4 op, ``Int4Linear`` either way): time a pass
  through one model's worth of projections (30 layers' qkv, o, gate_up and down, random int4 weights: streamed
  from memory, as in a decode step), 1, 4 and 16 rows; and the error of both against float64;
- the int8 matmul (``kernels/int8_matmul.c`` against fbgemm's two-pass path, ``Int8Linear`` either way): time the
  model's lm_head (random int8 weights, three copies taken in turn: streamed from memory, as in a decode step), 1
  to 256 rows, and one layer's four projections in int8 (``--quantization int8``), 2 to 2,048 rows; and the error
  of both against float64.

    python benchmarks/bench_native_kernels.py [--rounds 5] [--threads 1] [--contexts 64,256,1000,4000]
        [--decodes 1,8] [--int4-rows 1,4,16] [--int8-rows 1,4,16,64,256] [--int8-projection-rows 2,64,2048]
        [--sections attention,norm,layer_ops,int4,int8] [--out results/bench_native_kernels.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time

import torch
from bench_decode import memory_read_bandwidth
from harness import cpu_name, table, write_results

from kvprefix.cache.default_model import default_model_path
from kvprefix.model import (
    AttentionMetadata,
    attention,
    native_attention,
    native_int4,
    native_int8,
    native_layer_ops,
    native_norm,
)
from kvprefix.model.config import ModelConfig
from kvprefix.model.llama import RMSNorm
from kvprefix.model.quantized_linear import Int4Linear, Int8Linear
from kvprefix.model.rope import rotate_with_ops_


def seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def medians(timers, rounds: int) -> list[float]:
    """Each timer's (a callable returning seconds) median over ``rounds`` rounds, the timers taking turns in each
    round: what they compare is measured interleaved."""
    times: list[list[float]] = [[] for _ in timers]
    for _ in range(rounds):
        for timed, timer in zip(times, timers, strict=True):
            timed.append(timer())
    return [statistics.median(timed) for timed in times]


@contextlib.contextmanager
def without(module):
    """``module``'s kernel absent meanwhile (its ``kernel()`` gives None): PyTorch's path."""
    saved = module.kernel
    module.kernel = lambda: None
    try:
        yield
    finally:
        module.kernel = saved


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

        def pytorch_seconds(x=x, calls=calls) -> float:
            with without(native_norm):
                return seconds(lambda: norm(x), calls)

        native, pytorch = medians([lambda x=x, calls=calls: seconds(lambda: norm(x), calls), pytorch_seconds], rounds)
        with without(native_norm):
            expected = norm(x)
        rows.append({"rows": tokens, "native us": native * 1e6, "pytorch us": pytorch * 1e6, "ratio": native / pytorch,
                     "elements differing": f"{int((norm(x) != expected).sum())} of {x.numel()}"})
    return rows


def _rotary(fn, qkv: torch.Tensor, qk: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return fn(qkv.clone()[:, :qk], cos, sin)  # a fresh copy each call: rotary works in place


def layer_ops_rows(config: ModelConfig, rounds: int) -> list[dict]:
    """Rotary on the q and k heads of a qkv output, and SiLU-and-multiply on gate_up rows: kernel against PyTorch's
    ops, time a call and how many bfloat16 results differ."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inner = config.intermediate_size
    rows = []
    for tokens in (1, 4, 16, 1024):
        qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).bfloat16()
        angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 1000
        cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
        sin = torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()
        gate_up = (torch.randn(tokens, 2 * inner, generator=gen) * 3).bfloat16()
        qk = heads + kv_heads
        cases = {
            "rotary": (functools.partial(_rotary, native_layer_ops.rotary_, qkv, qk, cos, sin),
                       functools.partial(_rotary, rotate_with_ops_, qkv, qk, cos, sin)),
            "silu_mul": (functools.partial(native_layer_ops.silu_mul, gate_up, inner),
                         functools.partial(native_layer_ops.reference_silu_mul, gate_up, inner)),
        }
        calls = 200 if tokens <= 16 else 10
        for op, (native, pytorch) in cases.items():
            n, p = medians([functools.partial(seconds, native, calls), functools.partial(seconds, pytorch, calls)],
                           rounds)
            got, expected = native(), pytorch()
            rows.append({"op": op, "rows": tokens, "native us": n * 1e6, "pytorch us": p * 1e6, "ratio": n / p,
                         "elements differing": f"{int((got != expected).sum())} of {got.numel()}"})
    return rows


def int4_layers(config: ModelConfig, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q, scales, zeros) of every projection of the model, random, as the decoder stacks them."""
    hidden, inter, dim = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * dim
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(config.num_hidden_layers):
        for n, k in ((qkv, hidden), (hidden, config.num_attention_heads * dim), (2 * inter, hidden), (hidden, inter)):
            layers.append((torch.randint(0, 16, (n, k), generator=gen), torch.rand(n, k // 32, generator=gen) / 64,
                           torch.randn(n, k // 32, generator=gen) / 64))
    return layers


def int4_rows(config: ModelConfig, rounds: int, rows_options: list[int]) -> tuple[list[dict], list[dict]]:
    """(times, errors): a pass through every projection with the kernel and with PyTorch's op, and each side's
    relative error (norm) against float64 on the first layer's gate_up."""
    parts = int4_layers(config)
    native = [Int4Linear(*p) for p in parts]
    with without(native_int4):
        pytorch = [Int4Linear(*p) for p in parts]
    packed_bytes = sum(layer.nbytes() for layer in native)
    gen = torch.Generator().manual_seed(3)
    times_rows = []
    for rows in rows_options:
        inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {layer.in_features for layer in native}}
        sides = {"native": native, "pytorch": pytorch}

        def step(layers, inputs=inputs) -> None:
            for layer in layers:
                layer(inputs[layer.in_features])

        for layers in sides.values():
            step(layers)  # warm
        n, p = medians([functools.partial(seconds, functools.partial(step, layers), 3) for layers in sides.values()],
                       rounds)
        times_rows.append({"rows": rows, "native ms": n * 1e3, "pytorch ms": p * 1e3, "ratio": n / p,
                           "native GB/s": packed_bytes / n / 1e9, "pytorch GB/s": packed_bytes / p / 1e9})
    q, scales, zeros = parts[2]
    x = torch.randn(4, q.shape[1], generator=gen).bfloat16()
    exact = native_int4.reference_matmul(x, q, scales, zeros)
    errors = [{"rows": 4, **{f"{side} error": float((layers[2](x).double() - exact).norm() / exact.norm())
                             for side, layers in (("native", native), ("pytorch", pytorch))}}]
    return times_rows, errors


def int8_pair(q: torch.Tensor, scales: torch.Tensor, head: bool) -> tuple[Int8Linear, Int8Linear]:
    """(on the kernel, on fbgemm's path) for int8 weights q and scales; ``head``: as ``quantize_model`` sets the
    lm_head (int8 activations from one row, float32 logits)."""
    native = Int8Linear(q, scales)
    with without(native_int8):
        fbgemm = Int8Linear(q, scales)
    for layer in (native, fbgemm):
        if head:
            layer.int8_activations_above_rows, layer.keeps_float32 = 0, True
    return native, fbgemm


def int8_rows(config: ModelConfig, rounds: int, head_rows: list[int],
              projection_rows: list[int]) -> tuple[list[dict], list[dict]]:
    """(times, errors): the lm_head (three random copies, taken in turn) and one layer's four projections, on the
    kernel and on fbgemm's path, and each side's relative error (norm) against float64 on the lm_head."""
    gen = torch.Generator().manual_seed(5)
    hidden, inter, dim = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * dim

    def weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 500

    heads = [int8_pair(*weights(config.vocab_size, hidden), head=True) for _ in range(3)]
    projections = [int8_pair(*weights(n, k), head=False)
                   for n, k in ((qkv, hidden), (hidden, config.num_attention_heads * dim), (2 * inter, hidden),
                                (hidden, inter))]
    times_rows = []
    for name, pairs, rows_options in (("lm_head", heads, head_rows), ("projections", projections, projection_rows)):
        read = sum(native.nbytes() for native, _ in pairs)
        for rows in rows_options:
            inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {n.in_features for n, _ in pairs}}

            def step(side: int, pairs=pairs, inputs=inputs) -> None:
                for pair in pairs:
                    pair[side](inputs[pair[side].in_features])

            for side in (0, 1):
                step(side)  # warm
            calls = max(1, (64 if name == "projections" else 16) // rows)
            n, f = (t / len(pairs) if name == "lm_head" else t for t in
                    medians([functools.partial(seconds, functools.partial(step, side), calls) for side in (0, 1)],
                            rounds))
            times_rows.append({"matrix": name, "rows": rows, "native ms": n * 1e3, "fbgemm ms": f * 1e3,
                               "ratio": n / f})
            if name == "lm_head":  # the projections' 3.6 MB stay in cache between calls: no bandwidth to speak of
                per_call = read / len(pairs)
                times_rows[-1].update({"native GB/s": per_call / n / 1e9, "fbgemm GB/s": per_call / f / 1e9})
            print(f"int8 {name}, {rows} rows: {times_rows[-1]['ratio']:.2f}x", flush=True)
    native, fbgemm = heads[0]
    x = torch.randn(4, hidden, generator=gen).bfloat16()
    exact = x.double() @ (native.qweight.double() * native.scales.double()[:, None]).t()
    errors = [{"rows": 4, **{f"{side} error": float((layer(x).double() - exact).norm() / exact.norm())
                             for side, layer in (("native", native), ("fbgemm", fbgemm))}}]
    return times_rows, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two sides; medians reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="64,256,1000,4000", help="positions per decode")
    parser.add_argument("--decodes", default="1,8", help="decodes per call")
    parser.add_argument("--int4-rows", default="1,4,16", help="rows per int4 matmul")
    parser.add_argument("--int8-rows", default="1,4,16,64,256", help="rows per int8 lm_head")
    parser.add_argument("--int8-projection-rows", default="2,64,2048", help="rows per int8 projection")
    parser.add_argument("--sections", default="attention,norm,layer_ops,int4,int8", help="which comparisons run")
    parser.add_argument("--out", default="results/bench_native_kernels.json")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    torch.set_num_threads(args.threads)
    if native_attention.kernel() is None or native_norm.kernel() is None:
        raise SystemExit("the native kernels are not built here (a C compiler?): nothing to compare")
    if native_int4.kernel() is None:
        print("no native int4 kernel here (it needs AVX512-BF16): its comparison is left out")
    if native_int8.kernel() is None:
        print("no native int8 kernel here (it needs AVX512-VNNI): its comparison is left out")
    config = ModelConfig.from_path(default_model_path())
    cases = attention_cases(config, [int(c) for c in args.contexts.split(",")],
                            [int(d) for d in args.decodes.split(",")]) if "attention" in sections else []
    rows = []
    for i, case in enumerate(cases):
        for side in ("native", "pytorch"):
            case[side]()  # warm
        native, pytorch = (m / config.num_hidden_layers for m in
                           medians([functools.partial(seconds, case[side], 3) for side in ("native", "pytorch")],
                                   args.rounds))
        rows.append({"positions": case["positions"], "decodes": case["decodes"], "native us": native * 1e6,
                     "pytorch us": pytorch * 1e6, "ratio": native / pytorch,
                     "native GB/s": case["bytes"] / native / 1e9})
        print(f"[{i + 1}/{len(cases)}] {case['positions']} positions x {case['decodes']}: {rows[-1]['ratio']:.2f}x",
              flush=True)
    errors = attention_errors(config) if "attention" in sections else []
    norms = norm_rows(config, args.rounds) if "norm" in sections else []
    layer_ops = (layer_ops_rows(config, args.rounds)
                 if "layer_ops" in sections and native_layer_ops.kernels() is not None else [])
    if layer_ops:
        print("rotary and SiLU-and-multiply, microseconds a call (a rotary call includes copying qkv, both sides):")
        print(table(layer_ops, formats={"native us": ".1f", "pytorch us": ".1f", "ratio": ".2f"}) + "\n")
    int4_times, int4_errors = [], []
    if "int4" in sections and native_int4.kernel() is not None:
        int4_times, int4_errors = int4_rows(config, args.rounds, [int(r) for r in args.int4_rows.split(",")])
        print("int4 matmul: a pass through every projection (ms); GB/s: the packed weights read")
        print(table(int4_times, formats={"native ms": ".2f", "pytorch ms": ".2f", "ratio": ".2f",
                                         "native GB/s": ".1f", "pytorch GB/s": ".1f"}))
        print("int4 matmul against float64, relative error (norm):")
        print(table(int4_errors, formats={"native error": ".2e", "pytorch error": ".2e"}) + "\n")
    int8_times, int8_errors, read = [], [], []
    if "int8" in sections and native_int8.kernel() is not None:
        read = [memory_read_bandwidth(args.threads) / 1e9]
        int8_times, int8_errors = int8_rows(config, args.rounds, [int(r) for r in args.int8_rows.split(",")],
                                            [int(r) for r in args.int8_projection_rows.split(",")])
        read.append(memory_read_bandwidth(args.threads) / 1e9)
        print("int8 matmul: the lm_head (ms a call) and one layer's four projections (ms for the four); GB/s: the "
              f"int8 weights read, beside {min(read):.1f}-{max(read):.1f} GB/s read by bench_decode's sum over "
              "512 MiB (before and after)")
        print(table(int8_times, formats={"native ms": ".3f", "fbgemm ms": ".3f", "ratio": ".2f",
                                         "native GB/s": ".1f", "fbgemm GB/s": ".1f"}))
        print("int8 lm_head against float64, relative error (norm):")
        print(table(int8_errors, formats={"native error": ".2e", "fbgemm error": ".2e"}) + "\n")
    if errors:
        print("decode attention against float64, relative error (norm):")
        print(table(errors, formats={"native error": ".2e", "pytorch error": ".2e"}))
    if norms:
        print("\nRMSNorm, microseconds a call (the model's module):")
        print(table(norms, formats={"native us": ".1f", "pytorch us": ".1f", "ratio": ".2f"}))
    if rows:
        print("\ndecode attention: microseconds a layer; ratio = native / PyTorch time (below 1: the kernel faster); "
              "GB/s: the K and V read")
    write_results(args.out, {"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds, "attention": rows,
                             "attention_errors": errors, "rms_norm": norms, "layer_ops": layer_ops, "int4": int4_times,
                             "int4_errors": int4_errors, "int8": int8_times, "int8_errors": int8_errors,
                             "int8_read_GB_per_s": read}, rows,
                  formats={"native us": ".1f", "pytorch us": ".1f", "ratio": ".2f", "native GB/s": ".1f"})
    print(f"CPU: {cpu_name()}, {args.threads} thread(s)")


if __name__ == "__main__":
    main()

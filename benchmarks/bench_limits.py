"""How close the built-in model runs to this machine's limits, both measured in the same run.

Limits, at each thread count: matmul FLOP/s on the model's own projection shapes (one layer's qkv, o, gate_up and
down back to back, 1,024 and 2,048 rows: the best) in bfloat16, float32 and int8 (fbgemm's dynamic-quantized
linear: int8 weights, activations quantized per call), and the read bandwidth (``bench_decode``'s sum over 512 MiB).
Phases, through the engine (``LLM`` on token-id prompts, engine defaults): prefill of 1,024 and 4,096 tokens cold
and as a suffix after a cached 4,064-token prefix, as useful FLOP/s (projections, causal attention, the sampled
row's lm_head) over the peak of the dtype the layers compute in (compact layers: the dtype they dequantize to), with attention's share of the time (and of the FLOPs); decode of one
stream, as bytes per token (weights, one embedding row, the KV read) per second over the bandwidth. Each path
(``dequantized``: the file dequantized, dtype auto; ``gguf``: ``--quantization gguf``) at each thread count; a repeat runs
every path and thread count in turn, the order alternating, and measures the limits again before them; each
phase's fraction is the median over the repeats of its figure over that repeat's limit. ``--busy 0,1`` runs every
thread count also with that many other processes spinning (a core taken by other work, limits included), to see
whether the engine's threads wait at barriers the way llama.cpp's do.

    python benchmarks/bench_limits.py [--repeats 3] [--threads 1,2] [--busy 0] [--paths dequantized,gguf]
        [--phases cold,suffix,decode] [--prefill-sizes 1024,4096] [--out results/bench_limits.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch
from bench_decode import bytes_per_token, memory_read_bandwidth
from harness import cpu_name, dense_quantization, write_results

PREFIX_TOKENS = 4064  # the cached prefix of the suffix phases: the cold 4,096's first blocks (+4,096 fits 8,192)
PREFILL_SIZES = (1024, 4096)
DECODE_PROMPT, DECODE_TOKENS = 256, 64
PATHS = {"dequantized": "none", "gguf": "gguf"}  # name -> --quantization


def spinning_processes(n: int) -> contextlib.ExitStack:
    """``n`` processes spinning in pure Python until ``close()``: other work taking cores, as on a shared machine."""
    stack = contextlib.ExitStack()
    for _ in range(n):
        spinner = stack.enter_context(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        stack.callback(spinner.kill)
    return stack


# ---- limits ------------------------------------------------------------------------------------------------------


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def layer_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections, stacked as the model stacks them."""
    hidden, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inner, hidden), (hidden, inner)]


def _dense_linear(weight: torch.Tensor):
    return lambda x: x @ weight.t()


def _int8_linear(weight: torch.Tensor):
    """fbgemm's dynamic int8 linear on ``weight`` [out, in] (per-channel int8 weights, float32 in and out)."""
    scales = (weight.abs().amax(1) / 127).clamp_min(1e-12)
    q = torch.quantize_per_channel(weight, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0,
                                   torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)


def matmul_peak(config, dtype: str, rows_options=(1024, 2048)) -> float:
    """FLOP/s of one layer's projections at the best of ``rows_options`` rows, in ``dtype`` ("int8": fbgemm)."""
    best = 0.0
    for rows in rows_options:
        calls, flops = [], 0
        for out_features, in_features in layer_shapes(config):
            w = torch.randn(out_features, in_features) * 0.05
            x = torch.randn(rows, in_features)
            if dtype == "int8":
                calls.append((_int8_linear(w), x))
            else:
                calls.append((_dense_linear(w.to(getattr(torch, dtype))), x.to(getattr(torch, dtype))))
            flops += 2 * rows * out_features * in_features
        best = max(best, flops / _best_seconds(lambda calls=calls: [f(x) for f, x in calls]))
    return best


# ---- phases ------------------------------------------------------------------------------------------------------


class AttentionTimer:
    """Seconds spent in paged attention (the model's attention call wrapped; a benchmark's instrument)."""

    def __init__(self) -> None:
        import kvprefix.model.llama as llama

        self.seconds = 0.0
        inner = llama.paged_attention

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        llama.paged_attention = timed


def prefill_flops(config, new: int, cached: int) -> dict[str, float]:
    """Useful FLOPs of computing ``new`` tokens after ``cached`` ones: projections, causal attention (each query
    against the keys up to its own position: QK and PV), and the lm_head of the one row that samples."""
    proj = 2 * new * sum(o * i for o, i in layer_shapes(config)) * config.num_hidden_layers
    keys = new * cached + new * (new + 1) // 2  # sum over the new queries of the keys each sees
    attn = 4 * config.head_dim * config.num_attention_heads * config.num_hidden_layers * keys
    return {"projections": proj, "attention": attn, "lm_head": 2 * config.hidden_size * config.vocab_size}


class EnginePath:
    """One engine (a path) and the prompts it has not seen yet."""

    def __init__(self, name: str, seed: int) -> None:
        from kvprefix.cache.default_model import default_model_path
        from kvprefix.engine import LLM

        self.name = name
        quantization = dense_quantization() if PATHS[name] == "none" else PATHS[name]
        self.llm = LLM(default_model_path(), quantization=quantization, kv_cache_memory=512 << 20)
        self.model = self.llm.llm_engine.runner.model
        self.config = self.model.config
        self.gen = torch.Generator().manual_seed(seed)
        # What prefill's matmuls run in: compact layers dequantize to their dense dtype (bfloat16 where native).
        from kvprefix.model import quantized_linear

        dense = quantized_linear._DENSE if PATHS[name] != "none" else self.model.dtype
        self.compute_dtype = str(dense).removeprefix("torch.")

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.config.vocab_size, (n,), generator=self.gen).tolist()

    def prefill(self, prompt: list[int], timer: AttentionTimer, expect_cached: int) -> tuple[float, float]:
        """(wall seconds, attention seconds) of one prompt's prefill (max_tokens=1)."""
        from kvprefix.engine import SamplingParams

        timer.seconds = 0.0
        start = time.perf_counter()
        out = self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        wall = time.perf_counter() - start
        if out.num_cached_tokens != expect_cached:
            raise RuntimeError(f"{self.name}: {out.num_cached_tokens} cached tokens, expected {expect_cached}")
        return wall, timer.seconds

    def decode(self) -> float:
        """Seconds per output token of one stream (first token to last)."""
        from kvprefix.engine import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
        m = self.llm.generate([self.tokens(DECODE_PROMPT)], params)[0].metrics
        return (m.finished_time - m.first_token_time) / (DECODE_TOKENS - 1)


def run_phases(path: EnginePath, phases: list[str], timer: AttentionTimer,
               sizes: tuple[int, ...] = PREFILL_SIZES) -> dict[str, dict]:
    """One repeat of every phase on ``path``: {phase name: {"seconds", "attention_s", "flops" | "bytes"}}."""
    out = {}
    prefix = None
    if "cold" in phases or "suffix" in phases:
        for n in sizes:
            prompt = path.tokens(n)
            wall, attn = path.prefill(prompt, timer, 0)
            out[f"prefill {n} cold"] = {"seconds": wall, "attention_s": attn,
                                        "flops": prefill_flops(path.config, n, 0)}
            if n >= PREFIX_TOKENS:
                prefix = prompt[:PREFIX_TOKENS]  # cached now: the suffix phases start from it
    if "suffix" in phases:  # the cold phases ran too: they cached the prefix
        for n in sizes:
            wall, attn = path.prefill(prefix + path.tokens(n), timer, PREFIX_TOKENS)
            out[f"prefill {n} after cached {PREFIX_TOKENS}"] = {
                "seconds": wall, "attention_s": attn, "flops": prefill_flops(path.config, n, PREFIX_TOKENS)}
    if "decode" in phases:
        context = DECODE_PROMPT + DECODE_TOKENS // 2  # the mean context a decode step reads
        out["decode 1 stream"] = {"seconds": path.decode(), "bytes": bytes_per_token(path.model, context)}
    return out


# ---- the report --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--busy", default="0", help="numbers of spinning processes to run each setting beside")
    parser.add_argument("--paths", default="dequantized,gguf")
    parser.add_argument("--phases", default="cold,suffix,decode")
    parser.add_argument("--prefill-sizes", default=",".join(map(str, PREFILL_SIZES)),
                        help=f"prompt tokens of the prefill phases (suffix needs one of at least {PREFIX_TOKENS})")
    parser.add_argument("--out", default="results/bench_limits.json")
    args = parser.parse_args()
    settings = [(int(t), int(b)) for t in args.threads.split(",") for b in args.busy.split(",")]
    phases = args.phases.split(",")
    unknown = [p for p in args.paths.split(",") if p not in PATHS] + [p for p in phases
                                                                      if p not in ("cold", "suffix", "decode")]
    if unknown:
        parser.error(f"unknown paths or phases {unknown}; paths: {list(PATHS)}, phases: cold, suffix, decode")
    sizes = tuple(int(n) for n in args.prefill_sizes.split(","))
    if "suffix" in phases and max(sizes) < PREFIX_TOKENS:
        parser.error(f"the suffix phases follow a cached {PREFIX_TOKENS}-token prefix: --prefill-sizes needs one "
                     f"of at least {PREFIX_TOKENS}")
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores; PyTorch's CPU capability {isa}; "
          f"bfloat16 native: {torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()})")
    timer = AttentionTimer()
    paths = [EnginePath(name, seed=i) for i, name in enumerate(args.paths.split(","))]
    config = paths[0].config
    samples: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    limits: dict[tuple[int, int], list[dict]] = defaultdict(list)
    loads = []
    for path in paths:  # first calls allocate and pack; not timed
        path.prefill(path.tokens(256), timer, 0)
        path.decode()
    for r in range(args.repeats):
        for t, busy in settings if r % 2 else settings[::-1]:
            # The limits again in every repeat, next to the phases they divide: other processes' load moves both.
            torch.set_num_threads(t)
            spinning = spinning_processes(busy)
            limit = {"read_bytes_per_s": memory_read_bandwidth(t),
                     **{f"{d}_flops": matmul_peak(config, d) for d in ("bfloat16", "float32", "int8")}}
            rates = ", ".join(f"{d} {limit[f'{d}_flops'] / 1e9:.0f}" for d in ("bfloat16", "float32", "int8"))
            print(f"{t} thread(s), {busy} busy: read {limit['read_bytes_per_s'] / 1e9:.1f} GB/s; matmul GFLOP/s on "
                  f"the model's shapes: {rates}", flush=True)
            for path in paths if r % 2 else paths[::-1]:
                for phase, result in run_phases(path, phases, timer, sizes).items():
                    if "flops" in result:
                        achieved = sum(result["flops"].values()) / result["seconds"]
                        result["fraction"] = achieved / limit[f"{path.compute_dtype}_flops"]
                    else:
                        result["fraction"] = result["bytes"] / result["seconds"] / limit["read_bytes_per_s"]
                    samples[(path.name, t, busy, phase)].append(result)
                    print(f"  {path.name}, {t} thread(s), {busy} busy, {phase}: {1000 * result['seconds']:.0f} ms, "
                          f"{result['fraction']:.2f} of the limit", flush=True)
            spinning.close()
            limits[(t, busy)].append(limit)
        loads.append(os.getloadavg()[0])
        print(f"repeat {r + 1}/{args.repeats} done, load average {loads[-1]:.1f}", flush=True)
    rows = []
    for (name, t, busy, phase), results in samples.items():
        seconds = statistics.median(x["seconds"] for x in results)
        path = next(p for p in paths if p.name == name)
        row = {"path": name, "threads": t, "busy": busy, "phase": phase, "ms": 1000 * seconds,
               "fraction": statistics.median(x["fraction"] for x in results)}  # each over its own repeat's limit
        if "flops" in results[0]:
            flops = sum(results[0]["flops"].values())
            peak = statistics.median(x[f"{path.compute_dtype}_flops"] for x in limits[(t, busy)])
            row.update(GFLOP=flops / 1e9, **{"GFLOP/s": flops / seconds / 1e9},
                       limit=f"{peak / 1e9:.0f} GFLOP/s ({path.compute_dtype})",
                       attention_share=statistics.median(x["attention_s"] / x["seconds"] for x in results),
                       attention_flop_share=results[0]["flops"]["attention"] / flops)
        else:
            nbytes = results[0]["bytes"]
            bandwidth = statistics.median(x["read_bytes_per_s"] for x in limits[(t, busy)])
            row.update(MB=nbytes / 1e6, **{"GB/s": nbytes / seconds / 1e9}, limit=f"{bandwidth / 1e9:.1f} GB/s read")
        rows.append(row)
    rows.sort(key=lambda r: (r["phase"], r["path"], r["threads"], r["busy"]))
    write_results(args.out, {"cpu": cpu_name(), "cpu_capability": isa,
                             "limits": {f"{t} threads, {b} busy": v for (t, b), v in limits.items()},
                             "load_averages": loads,
                             "repeats": args.repeats, "rows": rows,
                             "samples": {" | ".join(map(str, k)): v for k, v in samples.items()}},
                  rows, ["phase", "path", "threads", "busy", "ms", "GFLOP", "MB", "GFLOP/s", "GB/s", "limit",
                         "fraction", "attention_share", "attention_flop_share"],
                  {"ms": ".1f", "GFLOP": ".1f", "MB": ".1f", "GFLOP/s": ".1f", "GB/s": ".2f", "fraction": ".2f",
                   "attention_share": ".2f", "attention_flop_share": ".2f"})
    print(f"load average during the repeats: {min(loads):.1f} - {max(loads):.1f}")


if __name__ == "__main__":
    main()

"""The cost of deterministic mode (issue 29): the same engine with batch-invariant numerics on vs off.

Model: the built-in default (SmolLM2-135M-Instruct) unless --model, dtype auto (bfloat16 on CPUs with native
bfloat16), CPU. Both engines live at the same time and run interleaved, round by round (on, off, on, off, ...), so
a shared machine's load falls on both alike. Per round and engine:
  - prefill: one cold --prefill-tokens prompt (fresh tokens, nothing cached), 1 output token: prompt tokens / TTFT;
  - hit TTFT: a prompt whose --prefill-tokens prefix is cached, plus 32 fresh tokens, 1 output token;
  - decode at 1, 8 and 32 streams: that many fresh 16-token prompts at once, 32 greedy tokens each: tokens after
    the first / (last finish - last first token).
Reported: the median over rounds of each figure, and on / off.

    python benchmarks/bench_determinism.py [--rounds 3] [--out results/bench_determinism.json]

--row-classes measures why the mode exists: for each projection shape of the default model and each dtype, row 0
of ``x[:m] @ w.T`` for m = 1 ... 2048, grouped into classes of bitwise-equal results (more than one class: a
row's bits depend on how many rows came with it).

    python benchmarks/bench_determinism.py --row-classes
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics

import torch
from harness import dense_quantization, write_results

from kvprefix import LLM, SamplingParams

STREAMS = (1, 8, 32)
DECODE_TOKENS = 32
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
DECODE = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)


def measure(llm: LLM, rng: random.Random, prefix: list[int], prefill_tokens: int) -> dict[str, float]:
    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    figures = {}
    cold = llm.generate([fresh(prefill_tokens)], FIRST_TOKEN)[0]
    figures["prefill tok/s"] = prefill_tokens / cold.metrics.ttft
    hit = llm.generate([prefix + fresh(32)], FIRST_TOKEN)[0]
    assert hit.num_cached_tokens >= len(prefix) - 16, "the prefix was not cached"
    figures["hit TTFT ms"] = hit.metrics.ttft * 1000
    for streams in STREAMS:
        outs = llm.generate([fresh(16) for _ in range(streams)], DECODE)
        span = max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs)
        figures[f"decode tok/s @{streams}"] = streams * (DECODE_TOKENS - 1) / span
    return figures


ROW_COUNTS = (1, 2, 4, 8, 15, 16, 17, 32, 33, 64, 65, 128, 129, 256, 300, 512, 1000, 2048)
SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}  # (in, out)


def row_classes() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for name, (k, n) in SHAPES.items():
            w, x = torch.randn(n, k).to(dtype), torch.randn(max(ROW_COUNTS), k).to(dtype)
            classes: list[tuple[torch.Tensor, list[int]]] = []
            for m in ROW_COUNTS:
                row = (x[:m] @ w.t())[0]
                same = next((c for c in classes if torch.equal(c[0], row)), None)
                if same is None:
                    classes.append((row, [m]))
                else:
                    same[1].append(m)
            print(f"{str(dtype).removeprefix('torch.'):8} {name:8} {len(classes)} classes:", [c[1] for c in classes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none",
                        help="none (dense, what docs/determinism.md measured), gguf, int8 or int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--out", default="results/bench_determinism.json")
    parser.add_argument("--row-classes", action="store_true", help="only measure matmul row-count dependence")
    args = parser.parse_args()
    if args.row_classes:
        return row_classes()
    quantization = dense_quantization() if args.quantization == "none" else args.quantization
    engines = {mode: LLM(args.model, dtype=args.dtype, quantization=quantization, device="cpu",
                         deterministic=mode == "on")
               for mode in ("on", "off")}
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 40000) for _ in range(args.prefill_tokens)]
    for llm in engines.values():  # warm-up, and the prefix the hit probes find cached
        llm.generate([prefix], FIRST_TOKEN)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            runs[mode].append(measure(llm, rng, prefix, args.prefill_tokens))
    rows = []
    for figure in runs["on"][0]:
        on, off = (statistics.median(r[figure] for r in runs[mode]) for mode in ("on", "off"))
        rows.append({"figure": figure, "deterministic on": on, "off": off, "on / off": on / off})
    results = {
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "dtype": str(engines["on"].llm_engine.runner.kv_caches[0].kv.dtype),
        "args": vars(args), "rows": rows, "runs": runs,
    }
    write_results(args.out, results, rows, formats={"deterministic on": ".1f", "off": ".1f", "on / off": ".2f"})


if __name__ == "__main__":
    main()

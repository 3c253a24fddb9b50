"""Server latency under concurrent streams, this tree against another source tree or other options, interleaved
(an A/B).

Each round starts `kvprefix serve` from one tree, then the other (the order alternates by round), and runs the same
closed-loop load on each: ``--streams`` clients, each sending streamed chat requests that share one system prompt
and differ in a short question, one after another. Reports per tree the medians over rounds of TTFT p50,
inter-token latency p50/p99 (client side: gaps between content chunks) and output tokens/s (content chunks over the
load's wall time), and the ratios baseline / this. ``--this-args`` / ``--baseline-args`` add `kvprefix serve`
options to each side (with ``--baseline-src .``: one tree, two settings).

    python benchmarks/bench_serving_ab.py --baseline-src ../kvprefix-previous --rounds 4 --streams 8
    python benchmarks/bench_serving_ab.py --baseline-src . --this-args "--cpu-threads 1" \
        --baseline-args "--cpu-threads 2" --streams 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
from harness import percentile, start_serve, write_results

SYSTEM = "You are a support assistant for an online shop. " * 40


async def one_stream(client: httpx.AsyncClient, url: str, model: str, question: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return {"ttft": times[0] - t0, "gaps": [b - a for a, b in itertools.pairwise(times)]}


async def load(url: str, streams: int, requests_per_stream: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        await one_stream(client, url, model, "warm-up", max_tokens)  # caches the system prompt
        start = time.perf_counter()

        async def client_loop(c: int) -> list[dict]:
            return [await one_stream(client, url, model, f"Client {c}, question {i}: where is my order?",
                                     max_tokens) for i in range(requests_per_stream)]

        results = [r for rs in await asyncio.gather(*(client_loop(c) for c in range(streams))) for r in rs]
        wall = time.perf_counter() - start
    gaps = [g for r in results for g in r["gaps"]]
    return {"ttft_p50_ms": 1000 * percentile([r["ttft"] for r in results], 50),
            "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99),
            "output_tokens_per_s": sum(len(r["gaps"]) + 1 for r in results) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-src", required=True, metavar="DIR", help="the other tree (its src/ is used)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    p.add_argument("--this-args", default="", help="extra `kvprefix serve` options for this tree")
    p.add_argument("--baseline-args", default="", help="extra `kvprefix serve` options for the baseline")
    p.add_argument("--out", default="results/bench_serving_ab.json")
    args = p.parse_args()
    trees = {"this": str(Path(__file__).resolve().parents[1] / "src"),
             "baseline": str(Path(args.baseline_src).resolve() / "src")}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        for name in order:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            extra = (["--model", args.model] if args.model else []) + shlex.split(getattr(args, f"{name}_args"))
            server = start_serve(["--max-num-seqs", "64", *extra], env=env)
            try:
                res = asyncio.run(load(server.url, args.streams, args.requests_per_stream, args.max_tokens))
            finally:
                server.stop()
            runs[name].append(res)
            print(f"round {rnd + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), file=sys.stderr)
    rows = []
    for key in runs["this"][0]:
        this = statistics.median(r[key] for r in runs["this"])
        base = statistics.median(r[key] for r in runs["baseline"])
        rows.append({"metric": key, "this": this, "baseline": base, "baseline_over_this": base / this})
    print(f"{args.streams} streams, {args.rounds} interleaved rounds, medians of rounds; baseline: {args.baseline_src}")
    write_results(args.out, {"config": vars(args), "runs": runs, "rows": rows}, rows,
                  formats={"this": ".1f", "baseline": ".1f", "baseline_over_this": ".2f"})


if __name__ == "__main__":
    main()

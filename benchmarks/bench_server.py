"""`kvprefix serve` under shared-system-prompt chat traffic, prefix caching on vs off, side by side in one run.

Starts the server twice on loopback (caching on, then off) and, at each request rate, sends Poisson arrivals of
streaming chat requests that share one long system prompt and differ in a short user question. Reports TTFT
p50/p99 (client-side: request sent -> first content chunk), end-to-end p50, throughput, and the prefix-cache hit
rate (token-weighted, from the server's /metrics counters). The cache is reset before each rate.

    python benchmarks/bench_server.py [--rates 1,2,4] [--requests 40] [--out results/bench_server.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

import httpx
from harness import Process, counters, percentile, start_serve, system_prompt, write_results


def start_server(caching: bool, args: argparse.Namespace) -> Process:
    serve = ["--num-gpu-blocks", str(args.num_blocks), "--max-num-seqs", "64",
             "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    return start_serve([*serve, *(["--model", args.model] if args.model else [])], stdout=subprocess.DEVNULL)


async def one_request(client: httpx.AsyncClient, url: str, model: str, system: str, question: str,
                      max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "end": time.perf_counter(), "start": t0,
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def run_rate(url: str, model: str, rate: float, requests: int, max_tokens: int, system: str) -> dict:
    rng = random.Random(int(rate * 1000))
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = []
        for i in range(requests):
            question = f"Ticket {i}: customer {rng.randrange(10**6)} asks about order {rng.randrange(10**6)}."
            tasks.append(asyncio.create_task(one_request(client, url, model, system, question, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    ttfts = [r["ttft"] for r in results]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "e2e_p50_ms": 1000 * percentile((r["e2e"] for r in results), 50),
        "throughput_rps": len(results) / span,
        "output_tok_s": sum(r["completion_tokens"] for r in results) / span,
        "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in results),
        "cached_tokens": statistics.mean(r["cached_tokens"] for r in results),
    }


def bench_mode(caching: bool, args: argparse.Namespace, system: str) -> dict[float, dict]:
    server = start_server(caching, args)
    url = server.url
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_rate(url, model, 100.0, 4, args.max_tokens, system))  # warm-up
        out = {}
        for rate in args.rates:
            httpx.post(url + "/reset_prefix_cache?wait=true&timeout=60", timeout=70).raise_for_status()
            before = counters(url)
            res = asyncio.run(run_rate(url, model, rate, args.requests, args.max_tokens, system))
            after = counters(url)
            queries = after["kvprefix:prefix_cache_queries_total"] - before["kvprefix:prefix_cache_queries_total"]
            hits = after["kvprefix:prefix_cache_hits_total"] - before["kvprefix:prefix_cache_hits_total"]
            res["hit_rate"] = hits / queries if queries else 0.0
            out[rate] = res
            print(f"  caching {'on ' if caching else 'off'} rate {rate:g}/s: TTFT p50 {res['ttft_p50_ms']:.0f} ms, "
                  f"hit rate {res['hit_rate']:.3f}", file=sys.stderr)
        return out
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,2,4", help="request rates (req/s), comma-separated")
    p.add_argument("--requests", type=int, default=40, help="requests per rate")
    p.add_argument("--system-words", type=int, default=200, help="words in the shared system prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="results/bench_server.json")
    args = p.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    system = system_prompt(args.system_words)
    results = {mode: bench_mode(mode == "on", args, system) for mode in ("on", "off")}

    prompt_tokens = results["on"][args.rates[0]]["prompt_tokens"]
    print(f"\nshared-system-prompt chat, {args.requests} requests per rate, ~{prompt_tokens:.0f} prompt tokens "
          f"({args.max_tokens} output tokens each), Poisson arrivals\n")
    rows = []
    for rate in args.rates:
        on, off = results["on"][rate], results["off"][rate]
        for mode, r in (("on", on), ("off", off)):
            rows.append({"rate (req/s)": rate, "caching": mode, "TTFT p50 (ms)": r["ttft_p50_ms"],
                         "TTFT p99 (ms)": r["ttft_p99_ms"], "e2e p50 (ms)": r["e2e_p50_ms"],
                         "throughput (req/s)": r["throughput_rps"], "output tok/s": r["output_tok_s"],
                         "hit rate": r["hit_rate"],
                         "TTFT p50 off/on": f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x" if mode == "on" else ""})
    write_results(args.out, {"config": {k: v for k, v in vars(args).items() if k != "out"},
                             "results": {m: {str(k): v for k, v in r.items()} for m, r in results.items()}},
                  rows, formats={"rate (req/s)": "g", "TTFT p50 (ms)": ".0f", "TTFT p99 (ms)": ".0f",
                                 "e2e p50 (ms)": ".0f", "throughput (req/s)": ".2f", "output tok/s": ".0f",
                                 "hit rate": ".3f"})


if __name__ == "__main__":
    main()

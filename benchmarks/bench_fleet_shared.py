"""Prefill a fleet computes for a shared-prefix workload, with and without the shared tier: how many times each
prefix is computed across --replicas `kvprefix serve` replicas behind `kvprefix route --policy round-robin`.

A `redis-server` this script starts; for each setting (replicas without a lower tier, then with `--kv-shared`),
fresh replicas and a router, then the workload at each --concurrency: --prefixes random prefixes of
--prefix-tokens tokens, each followed by --questions unique 16-token questions, shuffled, sent as token-id
completions with max_tokens=1 by that many clients. Each run draws new prefixes, so nothing earlier helps it.
Reported per run: prefix computations per prefix (the prefix tokens computed fleet-wide, i.e. the prefix's full
blocks minus the cached tokens of every request, over the prefixes' full-block tokens: 1.0 = once per fleet), TTFT
p50, and the requests that waited for blocks another replica had claimed, by outcome (docs/tiers.md#one-computation-
per-fleet). Target (issue 25): 1.0 with the tier, at any concurrency; without it up to --replicas.

    python benchmarks/bench_fleet_shared.py [--replicas 4] [--concurrency 1,4] [--out results/bench_fleet_shared.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_tiers import VOCAB, ttft
from harness import Process, start_route, start_serve, write_results
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' support package
from support.redis_server import RedisServer  # noqa: E402


def fleet(args: argparse.Namespace, tier: list[str]) -> tuple[list[Process], Process]:
    """--replicas fresh replicas (started side by side, then waited for) and a round-robin router over them."""
    flags = [*tier, *(["--model", args.model] if args.model else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    replicas = [start_serve(flags, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for _ in range(args.replicas)]
    router = start_route(["--policy", "round-robin", *[a for r in replicas for a in ("--replica", r.url)]],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return replicas, router


def claim_waits(replicas: list[Process]) -> Counter:
    """The replicas' waits on other replicas' claims so far, by outcome (``kv_tier_claim_waits_total``)."""
    out: Counter = Counter()
    for r in replicas:
        for family in text_string_to_metric_families(httpx.get(r.url + "/metrics", timeout=10).text):
            out.update({s.labels["outcome"]: s.value for s in family.samples
                        if s.name == "kvprefix:kv_tier_claim_waits_total"})
    return out


def workload(router: Process, args: argparse.Namespace, concurrency: int, rng: random.Random) -> dict:
    prefixes = [[rng.randrange(*VOCAB) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    requests = [p + [rng.randrange(*VOCAB) for _ in range(16)] for p in prefixes for _ in range(args.questions)]
    rng.shuffle(requests)
    ttft(router, [rng.randrange(*VOCAB) for _ in range(32)])  # the router's connections, warm

    def send(prompt: list[int]) -> tuple[float, int]:
        out = ttft(router, prompt)
        time.sleep(args.gap)
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, requests))
    full = args.prefix_tokens // 16 * 16
    computed = sum(full - cached for _, cached in results)
    return {"prefix_computations": computed / (full * args.prefixes),
            "ttft_p50_ms": 1000 * statistics.median(t for t, _ in results), "requests": len(results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--questions", type=int, default=8, help="requests per prefix")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--concurrency", default="1,4", help="comma-separated numbers of clients")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds a client waits between its requests")
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    parser.add_argument("--out", default="results/bench_fleet_shared.json")
    args = parser.parse_args()
    rng = random.Random(0)
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="fleet-shared-bench-") as tmp:
        redis = RedisServer(Path(tmp), "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru").start()
        try:
            for name, tier in (("without the tier", []), ("with --kv-shared", ["--kv-shared", redis.url])):
                replicas, router = fleet(args, tier)
                try:
                    for c in (int(x) for x in args.concurrency.split(",")):
                        before = claim_waits(replicas)
                        run = workload(router, args, c, rng)
                        waits = claim_waits(replicas) - before
                        run["claim_waits"] = ", ".join(f"{int(n)} {k}" for k, n in sorted(waits.items())) or "0"
                        results[f"{name}, {c} clients"] = run
                        rows.append({"replicas": name, "clients": c, **run})
                        print(rows[-1], flush=True)
                finally:
                    for p in (router, *replicas):
                        p.stop()
        finally:
            redis.stop()
    write_results(args.out, results, rows, formats={"prefix_computations": ".2f", "ttft_p50_ms": ".0f"})


if __name__ == "__main__":
    main()

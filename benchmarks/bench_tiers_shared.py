"""The shared tier on Redis: load throughput against a raw GET of the same bytes, and TTFT of a long prefix served
from the shared tier vs the pool vs nowhere, interleaved in one run, on a `redis-server` this script starts.

Part 1, in this process: --blocks objects of the default model's block size (bf16 KV of SmolLM2-135M: 368,640
payload bytes) stored with `RedisStore`, then rounds alternating (a) a raw `GET` of every key with a plain client
and (b) `RedisStore.load_into` of every block (GET, full verification, copy into a preallocated block); and a run
looked up with one pipelined `EXISTS` per block vs one round trip per block. Part 2: two `kvprefix serve
--kv-shared` replicas (the default model unless --model; OMP_NUM_THREADS=1) on that Redis; each round a new
random prefix of --prefix-tokens tokens goes to replica A (nowhere: computed, then written behind), then, in
alternating order, to A again (in its pool) and to B for the first time (from the shared tier). Every request is a
completion of token ids with max_tokens=1, so its latency is its TTFT.

    python benchmarks/bench_tiers_shared.py [--rounds 5] [--prefix-tokens 2000] [--out results/bench_tiers_shared.json]
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
from pathlib import Path

from bench_tiers import VOCAB, ttft
from harness import Process, counters, start_serve, write_results

from kvprefix.tiers import KVSpec, RedisStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' support package
from support.redis_server import RedisServer  # noqa: E402
from support.tier_blocks import chain, expected  # noqa: E402

# The default model's KV layout (30 layers, 3 KV heads of 64, bfloat16) in blocks of 16 tokens.
DEFAULT_SPEC = KVSpec(model="bench", kv_dtype="bfloat16", element_size=2, block_size=16, num_layers=30,
                      num_kv_heads=3, head_size=64)


def throughput(server: RedisServer, args: argparse.Namespace) -> dict:
    """GB/s of raw GETs vs the store's verified loads of the same objects, alternating; lookup latencies."""
    store = RedisStore(server.url, DEFAULT_SPEC, timeout=5)
    blocks = chain(args.blocks, seed=1, spec=DEFAULT_SPEC)
    for b in blocks:
        assert store.store(b)
    keys = [store.key(b.namespace, b.block_hash) for b in blocks]
    raw_client = server.client()
    spans = [memoryview(bytearray(DEFAULT_SPEC.payload_bytes))]
    nbytes = sum(len(raw_client.get(k)) for k in keys)  # also warms both paths' connections
    speeds: dict[str, list[float]] = {"raw GET": [], "store load": []}

    def raw() -> None:
        for k in keys:
            raw_client.get(k)

    def load() -> None:
        for b in blocks:
            assert store.load_into(expected(b), spans)

    order = (("raw GET", raw), ("store load", load))
    for r in range(args.rounds * 2):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fn()
            speeds[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    hashes, ns = [b.block_hash for b in blocks], blocks[0].namespace
    lookups: dict[str, list[float]] = {"pipelined": [], "one by one": []}
    for _ in range(args.rounds * 2):
        t0 = time.perf_counter()
        assert store.lookup(hashes, ns) == len(hashes)
        lookups["pipelined"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert all(store.contains(h, ns) for h in hashes)
        lookups["one by one"].append(time.perf_counter() - t0)
    raw_client.flushall()
    return {"object_bytes": nbytes // len(keys), "gb_per_s": speeds,
            "load_over_raw": statistics.median(speeds["store load"]) / statistics.median(speeds["raw GET"]),
            "lookup_s": lookups}


def serve(args: argparse.Namespace, url: str) -> Process:
    flags = ["--kv-shared", url] + (["--model", args.model] if args.model else [])
    return start_serve(flags, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)


def stored(server: Process, blocks: float, timeout: float = 60) -> float:
    """Waits until the replica has written at least ``blocks`` blocks to the shared tier; returns its count."""
    deadline = time.monotonic() + timeout
    while (n := counters(server.url).get("kvprefix:kv_tier_stores_total", 0)) < blocks:
        assert time.monotonic() < deadline, "writes did not land"
        time.sleep(0.05)
    return n


def ttft_rounds(url: str, args: argparse.Namespace, rng: random.Random) -> dict[str, list[float]]:
    a, b = serve(args, url), serve(args, url)
    times: dict[str, list[float]] = {"pool": [], "shared": [], "nowhere": []}
    full = args.prefix_tokens // 16
    try:
        for s in (a, b):
            ttft(s, [rng.randrange(*VOCAB) for _ in range(64)])  # warm-up
        written = stored(a, 0)
        for r in range(args.rounds):
            prefix = [rng.randrange(*VOCAB) for _ in range(args.prefix_tokens)]
            t, cached = ttft(a, prefix + [rng.randrange(*VOCAB) for _ in range(16)])
            assert cached == 0, cached
            times["nowhere"].append(t)
            written = stored(a, written + full)
            for where in ("pool", "shared") if r % 2 == 0 else ("shared", "pool"):
                t, cached = ttft(a if where == "pool" else b, prefix + [rng.randrange(*VOCAB) for _ in range(16)])
                assert cached == full * 16, (where, cached)
                times[where].append(t)
    finally:
        a.stop()
        b.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=125, help="objects in the throughput part (125: 2,000 tokens)")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    parser.add_argument("--out", default="results/bench_tiers_shared.json")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="tiers-shared-bench-") as tmp:
        redis = RedisServer(Path(tmp), "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru").start()
        try:
            results = throughput(redis, args)
            times = ttft_rounds(redis.url, args, rng)
        finally:
            redis.stop()
    pairs = list(zip(times["shared"], times["pool"], times["nowhere"], strict=True))
    results |= {"prefix_tokens": args.prefix_tokens, "times_s": times,
                "shared_over_pool": statistics.median(s / p for s, p, _ in pairs),
                "shared_over_nowhere": statistics.median(s / n for s, _, n in pairs)}
    rows = [{"prefix": k, "TTFT p50 ms": 1000 * statistics.median(v), "runs": len(v), "min ms": 1000 * min(v),
             "max ms": 1000 * max(v)} for k, v in times.items()]
    write_results(args.out, results, rows, formats={"TTFT p50 ms": ".1f", "min ms": ".1f", "max ms": ".1f"})
    g, lk = results["gb_per_s"], results["lookup_s"]
    print(f"{results['object_bytes']:,}-byte objects: raw GET {statistics.median(g['raw GET']):.2f} GB/s, store load "
          f"{statistics.median(g['store load']):.2f} GB/s ({results['load_over_raw']:.2f}x); lookup of {args.blocks} "
          f"blocks {1000 * statistics.median(lk['pipelined']):.2f} ms pipelined vs "
          f"{1000 * statistics.median(lk['one by one']):.2f} ms one by one; per round, median: shared / pool "
          f"{results['shared_over_pool']:.2f}x, shared / nowhere {results['shared_over_nowhere']:.3f}x")


if __name__ == "__main__":
    main()

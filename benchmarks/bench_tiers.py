"""TTFT of a request whose long prefix is in the pool, only on the disk tier, or nowhere, interleaved in one run.

One `kvprefix serve --kv-disk DIR` (the default model unless --model; OMP_NUM_THREADS=1). First the restart case:
a server computes a prefix and stops; a new one on the same directory answers a request on it (disk after a
restart). Then rounds, each with a new random prefix of --prefix-tokens tokens: nowhere (computed, and written
behind), in the pool, and only on disk (the pool emptied by /reset_prefix_cache, so the blocks come from the
tier: the same path as after a restart), pool and disk alternating in order. Every request is a completion of
token ids with max_tokens=1, so its latency is its TTFT. Also reads the tier's files back sequentially in this
process (warm page cache, as the server's loads are) to compare the load throughput with the disk's.

    python benchmarks/bench_tiers.py [--rounds 5] [--prefix-tokens 2000] [--out results/bench_tiers.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import time

import httpx
from harness import Process, counters, start_serve, write_results

from kvprefix.tiers import disk_layout as layout

VOCAB = (100, 40000)  # token ids valid in the default model's vocabulary (and the test models' bigger ones)


def serve(args: argparse.Namespace, tier: str) -> Process:
    flags = ["--kv-disk", tier, "--kv-disk-size", "20GiB", *(["--model", args.model] if args.model else [])]
    return start_serve(flags, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)


def ttft(server: Process, prompt: list[int]) -> tuple[float, int]:
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def written_behind(server: Process, blocks: int, timeout: float = 60) -> None:
    """Waits until the tier holds at least ``blocks`` objects (the write-behind queue has drained)."""
    deadline = time.monotonic() + timeout
    while counters(server.url).get("kvprefix:kv_tier_num_objects", 0) < blocks and time.monotonic() < deadline:
        time.sleep(0.05)


def sequential_read(tier: str) -> float:
    """GB/s reading every object of the tier whole, in directory order."""
    paths = [e.path for e in layout.iter_objects(tier)]
    t0, total = time.perf_counter(), 0
    for p in paths:
        with open(p, "rb") as f:
            total += len(f.read())
    return total / (time.perf_counter() - t0) / 1e9


def rounds(server: Process, args: argparse.Namespace, rng: random.Random) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"pool": [], "disk": [], "nowhere": []}
    objects = counters(server.url).get("kvprefix:kv_tier_num_objects", 0)
    full = args.prefix_tokens // 16

    def question() -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(16)]

    for r in range(args.rounds):
        prefix = [rng.randrange(*VOCAB) for _ in range(args.prefix_tokens)]
        t, cached = ttft(server, prefix + question())
        times["nowhere"].append(t)
        assert cached == 0, cached
        objects += full + 1  # the prefix's blocks and the question's
        written_behind(server, objects)
        order = ("pool", "disk") if r % 2 == 0 else ("disk", "pool")
        for where in order:
            if where == "disk":
                httpx.post(server.url + "/reset_prefix_cache?wait=true", timeout=60).raise_for_status()
            t, cached = ttft(server, prefix + question())
            assert cached == full * 16, (where, cached)
            times[where].append(t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    parser.add_argument("--out", default="results/bench_tiers.json")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="tiers-bench-") as tmp:
        tier = os.path.join(tmp, "tier")
        first = serve(args, tier)
        try:
            ttft(first, [rng.randrange(*VOCAB) for _ in range(64)])  # warm-up
            prefix = [rng.randrange(*VOCAB) for _ in range(args.prefix_tokens)]
            cold_first, _ = ttft(first, prefix + [rng.randrange(*VOCAB) for _ in range(16)])
        finally:
            first.stop()  # a graceful stop finishes the queued writes
        server = serve(args, tier)
        try:
            ttft(server, [rng.randrange(*VOCAB) for _ in range(64)])  # warm-up, not on the prefix
            after_restart, cached = ttft(server, prefix + [rng.randrange(*VOCAB) for _ in range(16)])
            assert cached == args.prefix_tokens // 16 * 16, cached
            times = rounds(server, args, rng)
            m = counters(server.url)
        finally:
            server.stop()
        read_gbs = sequential_read(tier)
    med = {k: statistics.median(v) for k, v in times.items()}
    prefix_bytes = m["kvprefix:kv_tier_bytes_read_total"] / (args.rounds + 1)
    load_gbs = prefix_bytes / max(med["disk"] - med["pool"], 1e-6) / 1e9
    rows = [{"prefix": k, "TTFT p50 ms": 1000 * med[k], "runs": len(times[k]),
             "min ms": 1000 * min(times[k]), "max ms": 1000 * max(times[k])} for k in ("pool", "disk", "nowhere")]
    rows.append({"prefix": "disk, first request after a restart", "TTFT p50 ms": 1000 * after_restart, "runs": 1})
    results = {"prefix_tokens": args.prefix_tokens, "times_s": times, "after_restart_s": after_restart,
               "cold_first_server_s": cold_first, "disk_over_pool": med["disk"] / med["pool"],
               "disk_over_nowhere": med["disk"] / med["nowhere"], "prefix_bytes": prefix_bytes,
               "load_gb_per_s_implied": load_gbs, "sequential_read_gb_per_s": read_gbs}
    write_results(args.out, results, rows, formats={"TTFT p50 ms": ".1f", "min ms": ".1f", "max ms": ".1f"})
    print(f"disk / pool {results['disk_over_pool']:.2f}x, disk / nowhere {results['disk_over_nowhere']:.3f}x; "
          f"{prefix_bytes / 1e6:.1f} MB per prefix, loaded at {load_gbs:.2f} GB/s implied (TTFT disk - pool) vs "
          f"{read_gbs:.2f} GB/s sequential read of the tier's files")


if __name__ == "__main__":
    main()

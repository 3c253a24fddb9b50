"""TTFT of a request whose long prefix is in the pool, only on the disk tier, or nowhere, interleaved in one run.

One `kvprefix serve --kv-disk DIR` (the default model unless --model; OMP_NUM_THREADS=1). First the restart case:
a server computes a prefix and stops; a new one on the same directory answers a request on it (disk after a
restart). Then rounds, each with a new random prefix of --prefix-tokens tokens: nowhere (computed, and written
behind), in the pool, and only on disk (the pool emptied by /reset_prefix_cache, so the blocks come from the
tier: the same path as after a restart), pool and disk alternating in order. Every request is a completion of
token ids with max_tokens=1, so its latency is its TTFT. Also reads the tier's files back sequentially in this
process (warm page cache, as the server's loads are), alternating with the tier's own loads of them, to compare the
load throughput with the disk's, and compares
decode tokens/s with the tier (write-behind of every generated block) and without, alternating two fresh servers.

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
import numpy as np
from harness import Process, counters, start_serve, write_results

from kvprefix.cache import BlockIdentity
from kvprefix.tiers import DiskStore, Expected
from kvprefix.tiers import disk_layout as layout
from kvprefix.tiers.objects import decode_header

VOCAB = (100, 40000)  # token ids valid in the default model's vocabulary (and the test models' bigger ones)


def serve(args: argparse.Namespace, tier: str | None) -> Process:
    flags = ["--kv-disk", tier, "--kv-disk-size", "20GiB"] if tier else []
    flags += ["--model", args.model] if args.model else []
    return start_serve(flags, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)


def ttft(server: Process, prompt: list[int], max_tokens: int = 1) -> tuple[float, int]:
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
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


def read_rates(tier: str, prefix: list[int], hasher, repeats: int) -> dict[str, list[float]]:
    """GB/s of the prefix's blocks, alternating: a plain sequential read of their object files into one buffer of
    their total size (where a read of that many bytes lands), and the tier's own load (``DiskStore.load_into``:
    header checks, the payload read, the checksum) into such a buffer, as the server loads into its paged KV."""
    hashes = hasher.hash_blocks(prefix)
    paths = [layout.object_path(tier, h) for h in hashes]
    with open(paths[0], "rb") as f:
        spec = decode_header(f.read()).spec
    store = DiskStore(tier, 1 << 62, spec)
    bs = spec.block_size
    expected = [Expected(h, hashes[i - 1] if i else hasher.root, hasher.namespace_id,
                         tuple(prefix[i * bs : (i + 1) * bs])) for i, h in enumerate(hashes)]
    sizes = [os.path.getsize(p) for p in paths]
    files = bytearray(sum(sizes))
    kv = np.empty((len(hashes), spec.payload_bytes), dtype=np.uint8)
    rates: dict[str, list[float]] = {"sequential read": [], "tier load": []}
    for _ in range(repeats):
        t0, view = time.perf_counter(), memoryview(files)
        for p, size in zip(paths, sizes, strict=True):
            with open(p, "rb", buffering=0) as f:
                f.readinto(view[:size])
            view = view[size:]
        rates["sequential read"].append(len(files) / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        for i, e in enumerate(expected):
            assert store.load_into(e, [memoryview(kv[i])]), i
        rates["tier load"].append(len(files) / (time.perf_counter() - t0) / 1e9)
    return rates


def decode_rates(servers: dict[str, Process], tokens: int, repeats: int, rng: random.Random) -> dict[str, list]:
    """Decode tokens/s of one request per server, alternating: (time of max_tokens=1 + tokens) - (max_tokens=1),
    on a short prompt the server has cached (so both times have the same prefill)."""
    rates: dict[str, list[float]] = {name: [] for name in servers}
    for r in range(repeats):
        prompt = [rng.randrange(*VOCAB) for _ in range(64)]
        order = list(servers.items())
        for name, server in order if r % 2 == 0 else order[::-1]:
            ttft(server, prompt)  # cache the prompt
            short, _ = ttft(server, prompt)
            long, _ = ttft(server, prompt, 1 + tokens)
            rates[name].append(tokens / (long - short))
    return rates


def rounds(server: Process, args: argparse.Namespace, rng: random.Random) -> tuple[dict[str, list[float]], float]:
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
            if where == "disk":
                last_prefix = prefix
    card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    hasher = BlockIdentity.from_dict(card["kvprefix"]["block_identity"]).hasher()
    return times, read_rates(args.tier, last_prefix[: full * 16], hasher, args.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=128, help="decode rate with the tier on vs off")
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
            args.tier = tier
            times, reads = rounds(server, args, rng)
            m = counters(server.url)
        finally:
            server.stop()
        # Two fresh servers, started alike: in one process, which of two engines was created first moved decode
        # tokens/s by 6%, tier or not, so the comparison takes like with like.
        fresh, plain = serve(args, os.path.join(tmp, "fresh-tier")), serve(args, None)
        try:
            rates = decode_rates({"tier on": fresh, "tier off": plain}, args.decode_tokens, args.rounds, rng)
        finally:
            fresh.stop()
            plain.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    prefix_bytes = m["kvprefix:kv_tier_bytes_read_total"] / (args.rounds + 1)
    # Paired within each round (the shared machine's load drifts between rounds more than within one).
    pairs = list(zip(times["disk"], times["pool"], times["nowhere"], strict=True))
    extra = statistics.median(d - p for d, p, _ in pairs)
    load_gbs = prefix_bytes / extra / 1e9 if extra > 0 else None
    rows = [{"prefix": k, "TTFT p50 ms": 1000 * med[k], "runs": len(times[k]),
             "min ms": 1000 * min(times[k]), "max ms": 1000 * max(times[k])} for k in ("pool", "disk", "nowhere")]
    rows.append({"prefix": "disk, first request after a restart", "TTFT p50 ms": 1000 * after_restart, "runs": 1})
    results = {"prefix_tokens": args.prefix_tokens, "times_s": times, "after_restart_s": after_restart,
               "cold_first_server_s": cold_first, "disk_over_pool": statistics.median(d / p for d, p, _ in pairs),
               "disk_over_nowhere": statistics.median(d / n for d, _, n in pairs), "prefix_bytes": prefix_bytes,
               "disk_minus_pool_s": extra,
               "load_gb_per_s_implied": load_gbs, "read_gb_per_s": reads,
               "tier_load_over_sequential_read": statistics.median(
                   t / r for t, r in zip(reads["tier load"], reads["sequential read"], strict=True)),
               "decode_tokens_per_s": rates,
               "decode_on_over_off": statistics.median(rates["tier on"]) / statistics.median(rates["tier off"])}
    write_results(args.out, results, rows, formats={"TTFT p50 ms": ".1f", "min ms": ".1f", "max ms": ".1f"})
    print(f"per round, median: disk / pool {results['disk_over_pool']:.2f}x, disk / nowhere "
          f"{results['disk_over_nowhere']:.3f}x, disk - pool {1000 * extra:.1f} ms; {prefix_bytes / 1e6:.1f} MB per "
          f"prefix, loaded at {load_gbs or float('nan'):.2f} GB/s implied (that difference); in this process the "
          f"tier loads its files at {statistics.median(reads['tier load']):.2f} GB/s against "
          f"{statistics.median(reads['sequential read']):.2f} GB/s for a sequential read of them "
          f"({results['tier_load_over_sequential_read']:.2f}x, paired); decode tokens/s with the tier "
          f"{results['decode_on_over_off']:.2f}x without")


if __name__ == "__main__":
    main()

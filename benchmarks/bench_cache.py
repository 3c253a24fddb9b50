"""Cache-core cost on workload W1, hashing throughput per algorithm, and eviction cost vs pool size.

W1: 2,000 sequential requests, each one of 20 system prompts of 1,024 tokens plus a unique 128-token suffix,
block size 16, pool = 30% of the distinct blocks. Every request is looked up, allocated (evicting as needed),
registered and freed through the real KVCacheManager.

    python benchmarks/bench_cache.py [--out results/bench_cache.json]
"""

from __future__ import annotations

import argparse
import random
import time

from harness import write_results

from kvprefix.cache import HASH_ALGOS, BlockHasher, CacheRequest, KVCacheManager

BLOCK_SIZE = 16


def w1_prompts(num_requests=2000, num_prefixes=20, prefix_len=1024, suffix_len=128, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = []
    for i in range(num_requests):
        prompts.append(prefixes[rng.randrange(num_prefixes)] + [rng.randrange(32000) for _ in range(suffix_len)])
        prompts[-1][prefix_len] = i % 32000  # the suffix's first token also makes every suffix unique
    return prompts


def distinct_blocks(requests: list[CacheRequest]) -> int:
    return len({h for r in requests for h in r.block_hashes}) + sum(r.num_tokens % BLOCK_SIZE > 0 for r in requests)


def run_w1(prompts: list[list[int]], pool_fraction: float) -> dict:
    hasher = BlockHasher(BLOCK_SIZE)
    t0 = time.perf_counter()
    requests = [CacheRequest(f"r{i}", p, hasher) for i, p in enumerate(prompts)]
    hash_s = time.perf_counter() - t0
    num_blocks = int(pool_fraction * distinct_blocks(requests))
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    timer = time.perf_counter
    lookup = allocate = register = free = 0.0
    for req in requests:
        t0 = timer()
        hits, n = manager.get_computed_blocks(req)
        t1 = timer()
        if manager.allocate_slots(req, req.num_tokens - n, hits) is None:
            raise RuntimeError("W1 pool too small for one request")
        t2 = timer()
        req.num_computed_tokens = req.num_tokens
        manager.cache_blocks(req, req.num_tokens)
        t3 = timer()
        manager.free(req)
        t4 = timer()
        lookup += t1 - t0
        allocate += t2 - t1
        register += t3 - t2
        free += t4 - t3
    n = len(requests)
    stats = manager.stats
    return {
        "requests": n,
        "pool_blocks": num_blocks,
        "us_per_request": {
            "hash": 1e6 * hash_s / n,
            "lookup": 1e6 * lookup / n,
            "allocate": 1e6 * allocate / n,
            "register": 1e6 * register / n,
            "free": 1e6 * free / n,
            "cache_ops_total": 1e6 * (lookup + allocate + register + free) / n,
        },
        "hit_rate_tokens": stats.hit_rate,
        "evictions": stats.evictions,
    }


def hashing_throughput(prompts: list[list[int]]) -> dict[str, float]:
    """Blocks hashed per second by each algorithm over all of W1's prompts."""
    out = {}
    num_blocks = sum(len(p) // BLOCK_SIZE for p in prompts)
    for algo in HASH_ALGOS:
        hasher = BlockHasher(BLOCK_SIZE, algo)
        t0 = time.perf_counter()
        for p in prompts:
            hasher.hash_blocks(p)
        out[algo] = num_blocks / (time.perf_counter() - t0)
    return out


def eviction_cost(pool_sizes=(1_000, 10_000, 100_000, 1_000_000), num_allocs=20_000) -> dict[int, float]:
    """µs per allocated block when every allocation evicts a cached block, for growing pools."""
    out = {}
    for size in pool_sizes:
        manager = KVCacheManager(size, BLOCK_SIZE)
        # Fill the pool with cached, unreferenced blocks: every later allocation must evict.
        filler = CacheRequest.from_block_hashes("fill", list(range(size)), size * BLOCK_SIZE, BLOCK_SIZE)
        manager.allocate_slots(filler, filler.num_tokens)
        manager.cache_blocks(filler, filler.num_tokens)
        manager.free(filler)
        reqs = [
            CacheRequest.from_block_hashes(f"r{i}", [size + i], BLOCK_SIZE, BLOCK_SIZE) for i in range(num_allocs)
        ]
        t0 = time.perf_counter()
        for r in reqs:
            manager.allocate_slots(r, BLOCK_SIZE)
            manager.cache_blocks(r, BLOCK_SIZE)
            manager.free(r)
        out[size] = 1e6 * (time.perf_counter() - t0) / num_allocs
        assert manager.stats.evictions == num_allocs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench_cache.json")
    parser.add_argument("--pool-fraction", type=float, default=0.30)
    args = parser.parse_args()

    prompts = w1_prompts()
    w1 = run_w1(prompts, args.pool_fraction)
    hashing = hashing_throughput(prompts)
    evict = eviction_cost()

    print(f"W1: {w1['requests']} requests, pool {w1['pool_blocks']} blocks (30% of distinct), block size 16")
    print("| phase | µs per request |\n|---|---|")
    for phase, us in w1["us_per_request"].items():
        print(f"| {phase} | {us:.1f} |")
    print(f"hit rate (token-weighted): {w1['hit_rate_tokens']:.4f} (ideal 0.880), evictions {w1['evictions']}")
    print("\n| algorithm | M blocks/s |\n|---|---|")
    for algo, rate in hashing.items():
        print(f"| {algo} | {rate / 1e6:.2f} |")
    print("\n| pool blocks | µs per evicting block allocation (allocate + register + free) |\n|---|---|")
    for size, us in evict.items():
        print(f"| {size:,} | {us:.2f} |")

    write_results(args.out, {"w1": w1, "hash_blocks_per_s": hashing, "evicting_alloc_us": evict})


if __name__ == "__main__":
    main()

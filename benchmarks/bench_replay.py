"""Planner replay throughput on the Mooncake synthetic trace (3,993 requests, 121,877 block refs, 512-token blocks).

Block refs per second = prompt blocks of the trace / seconds spent in the replay (trace parsing excluded; it is
timed separately). Each configuration is replayed several times; the table gives the median and the best.

The default trace is the repository's own copy (tests/data/traces), so the script runs from a fresh clone.
``--trace`` takes any Mooncake-format file instead, e.g. a larger one from the shared trace collection
(../shared/traces) when it sits beside the checkout; the configurations assume 512-token blocks.

    python benchmarks/bench_replay.py [--trace PATH] [--repeats 5] [--out results/bench_replay.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import write_results

from kvprefix.sim.formats import load_trace
from kvprefix.sim.metrics import summarize
from kvprefix.sim.replay import ReplayConfig, replay

TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
BLOCK = 512

CONFIGS = {
    "1 pool, 1e7 tokens, order": ReplayConfig(10_000_000 // BLOCK, mode="order"),
    "1 pool, 1e7 tokens, timed": ReplayConfig(10_000_000 // BLOCK, mode="timed"),
    "10 x 3e6, round-robin, order": ReplayConfig(3_000_000 // BLOCK, replicas=10, mode="order"),
    "10 x 3e6, kv-events, timed": ReplayConfig(
        3_000_000 // BLOCK, replicas=10, routing="kv-events", mode="timed"
    ),
}
SWEEP_TOKENS = (1e5, 3e5, 1e6, 2e6, 3e6, 5e6, 1e7, 2e7, 3e7, 5e7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/bench_replay.json")
    args = parser.parse_args()

    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    refs = trace.num_block_refs
    print(f"{trace.name}: {len(trace.requests):,} requests, {refs:,} block refs; parsed in {load_s:.3f} s\n")

    rows = []
    print(f"{'configuration':34} {'hit(tok)':>8} {'median refs/s':>14} {'best refs/s':>12}")
    for name, config in CONFIGS.items():
        times, summary = [], None
        for _ in range(args.repeats):
            rec = replay(trace, config)
            times.append(rec.elapsed_s)
            summary = summarize(trace, config, rec)
        median, best = refs / statistics.median(times), refs / min(times)
        rows.append({"configuration": name, "token_hit_rate": summary.token_hit_rate, "median_refs_per_s": median,
                     "best_refs_per_s": best, "times_s": times})  # fmt: skip
        print(f"{name:34} {summary.token_hit_rate:8.4f} {median:14,.0f} {best:12,.0f}")

    t0 = time.perf_counter()
    for tokens in SWEEP_TOKENS:
        replay(trace, ReplayConfig(int(tokens) // BLOCK, mode="order"))
    sweep_s = time.perf_counter() - t0
    span = f"{SWEEP_TOKENS[0]:.0e}..{SWEEP_TOKENS[-1]:.0e} tokens"
    print(f"\n10-point capacity sweep (1 pool, order, {span}): {sweep_s:.2f} s")

    write_results(args.out, {"trace": trace.name, "block_refs": refs, "parse_s": load_s, "configs": rows,
                             "sweep_10_points_s": sweep_s})


if __name__ == "__main__":
    main()

"""Hit rate per tier (pool, disk, miss) that `kvprefix simulate --disk-capacity` finds on every trace of
tests/data/traces: one replica, order mode, a pool too small for the trace's working set, a disk tier of 1 GiB and
of 10 GiB (the default `--kv-disk-size`) below it, sized at the default model's KV (23,040 bytes per token in
bfloat16), and the unbounded pool's hit rate as the bound. Deterministic: no timing is involved.

    python benchmarks/bench_sim_tiers.py [--out results/bench_sim_tiers.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import write_results

from kvprefix.sim.formats import load_trace
from kvprefix.sim.metrics import summarize
from kvprefix.sim.replay import ReplayConfig, replay

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces"
POOL_TOKENS = {"mooncake_synthetic_trace.jsonl": 131_072}  # 512-token blocks and prompts up to 60k tokens
DEFAULT_POOL_TOKENS = 8_192  # the 16-token-block traces
DISKS = {"1GiB": 2**30, "10GiB": 10 * 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench_sim_tiers.json")
    args = parser.parse_args()
    rows = []
    print("| trace | pool (tokens) | disk | pool hit | disk hit | miss | unbounded pool hit |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(TRACES.glob("*.jsonl")):
        trace = load_trace(path)
        pool_tokens = POOL_TOKENS.get(path.name, DEFAULT_POOL_TOKENS)
        bound = ReplayConfig(None, mode="order")
        unbounded = summarize(trace, bound, replay(trace, bound)).token_hit_rate
        for label, disk in DISKS.items():
            config = ReplayConfig(pool_tokens // trace.block_size, mode="order", disk_capacity_bytes=disk)
            s = summarize(trace, config, replay(trace, config))
            rows.append({"trace": path.name, "pool_tokens": pool_tokens, "disk_bytes": disk,
                         "pool_hit": s.pool_token_hit_rate, "disk_hit": s.disk_token_hit_rate,
                         "miss": 1 - s.token_hit_rate, "unbounded_hit": unbounded, "rejected": s.rejected})
            print(f"| {path.stem} | {pool_tokens:,} | {label} | {s.pool_token_hit_rate:.3f} | "
                  f"{s.disk_token_hit_rate:.3f} | {1 - s.token_hit_rate:.3f} | {unbounded:.3f} |")
    write_results(args.out, {"rows": rows})


if __name__ == "__main__":
    main()

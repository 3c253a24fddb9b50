"""`kvprefix simulate --shared-capacity`: one shared tier below every replayed pool. Round robin over replicas with
a shared tier that holds everything hits exactly as one unbounded shared pool; the tiers' shares add up to the hit
rate; `kv-events` spreads a hot prefix that is in the shared tier by load without computing it again; the CLI shows
the shared tier's hit rate beside the pool's and the imbalance per policy, and refuses bad sizes and costs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvprefix.sim.trace import Trace, TraceRequest

LMCACHE = "lmcache_multi_round_qa_example_bs16.jsonl"
VLLM = "vllm_prefix_repetition_default_bs16.jsonl"


@pytest.mark.parametrize("name, mode, pool", [(LMCACHE, "order", 400), (VLLM, "order", 40), (LMCACHE, "timed", 400)])
def test_round_robin_on_a_shared_tier_hits_as_one_shared_pool(load, run, name, mode, pool) -> None:
    """Every block is computed once for the fleet: the tier (unbounded) makes separate small pools hit as one."""
    trace = load(name)
    one_pool = run(trace, mode=mode, replicas=3, routing="shared")
    alone = run(trace, mode=mode, replicas=3, routing="round-robin", capacity_blocks=pool)
    tiered = run(trace, mode=mode, replicas=3, routing="round-robin", capacity_blocks=pool,
                 shared_capacity_bytes=10**13)
    assert tiered.token_hit_rate == one_pool.token_hit_rate > alone.token_hit_rate
    assert tiered.shared_token_hit_rate > 0 and tiered.shared_evictions == 0
    assert tiered.pool_token_hit_rate + tiered.shared_token_hit_rate == pytest.approx(tiered.token_hit_rate)


def test_disk_and_shared_add_up_and_a_small_shared_tier_evicts(load, run) -> None:
    trace = load(LMCACHE)
    s = run(trace, mode="order", replicas=2, routing="round-robin", capacity_blocks=400,
            disk_capacity_bytes=1000 * 16 * 23_040, shared_capacity_bytes=2000 * 16 * 23_040)
    assert s.disk_token_hit_rate > 0 and s.shared_token_hit_rate > 0 and s.shared_evictions > 0
    assert s.pool_token_hit_rate + s.disk_token_hit_rate + s.shared_token_hit_rate == pytest.approx(s.token_hit_rate)


def hot_prefix_bursts() -> Trace:
    """Ten bursts of twelve requests at once, each a 40-block system prompt and its own 2-block question."""
    system = [("system", k) for k in range(40)]
    return Trace("hot", 16, [TraceRequest((i // 12) * 2.0, 42 * 16 + 5, 16, [*system, ("q", i, 0), ("q", i, 1)], 43)
                             for i in range(120)])


def test_kv_events_spreads_a_hot_prefix_in_the_shared_tier_without_computing_it_again(run) -> None:
    """Without the tier the prefix stays where it was computed (spreading it would compute it again); with it the
    replicas load it: the load evens out, and no more prompt tokens are computed than without."""
    trace = hot_prefix_bursts()
    config = dict(mode="timed", replicas=3, routing="kv-events", capacity_blocks=200, prefill_tps=2000)
    without = run(trace, **config)
    tiered = run(trace, **config, shared_capacity_bytes=10**12)
    assert tiered.load_imbalance < without.load_imbalance - 0.3, (tiered.load_imbalance, without.load_imbalance)
    assert tiered.shared_token_hit_rate > 0
    assert tiered.prefill_tokens_with_cache <= without.prefill_tokens_with_cache
    assert tiered.waited < without.waited
    # `prefix` credits the shared tier from the moment it routes a prefix: in a burst it spreads the requests before
    # the first replica has written the blocks, and the others compute them (docs/router.md).
    early = run(trace, **{**config, "routing": "prefix"}, shared_capacity_bytes=10**12)
    assert early.prefill_tokens_with_cache > tiered.prefill_tokens_with_cache


@pytest.mark.slow
def test_the_cli_shows_the_shared_tier_and_refuses_bad_values(traces_dir, tmp_path) -> None:
    out = tmp_path / "runs.json"
    cmd = [sys.executable, "-m", "kvprefix.cli", "simulate", str(traces_dir / LMCACHE), "--mode", "order",
           "--replicas", "3", "--capacity-blocks", "400", "--routing", "round-robin,kv-events,shared",
           "--shared-capacity", "1GiB", "--no-progress"]
    r = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0].split()
    assert {"hit(pool)", "hit(shared)", "shared", "imbalance"} <= set(header) and "hit(disk)" not in header
    runs = json.loads(out.read_text())["runs"]
    assert [run["shared_capacity_bytes"] for run in runs] == [2**30] * 3
    assert all(run["pool_token_hit_rate"] + run["shared_token_hit_rate"] == pytest.approx(run["token_hit_rate"])
               for run in runs)
    for bad, option in ((["--shared-capacity", "lots"], "--shared-capacity"),
                        (["--shared-load-cost", "2"], "--shared-load-cost"),
                        (["--shared-capacity", "1KiB"], "shared capacity of 1024 bytes holds no")):
        r = subprocess.run([*cmd, *bad], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and option in r.stderr, (bad, r.stderr)
        assert "Traceback" not in r.stderr

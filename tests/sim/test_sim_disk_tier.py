"""`kvprefix simulate --disk-capacity`: a disk tier below each replayed pool. A disk that holds everything makes
pool + disk the unbounded pool's hit rate exactly; a larger disk never hits less; the disk tier evicts exactly as
the real `DiskStore` does (one `LRUBytes`); the CLI reports pool, disk and miss in text, JSON and a plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.tier_blocks import SPEC, chain, expected

from kvprefix.sim.tiers import SimTier
from kvprefix.tiers import DiskStore
from kvprefix.tiers.objects import encode

VLLM = "vllm_prefix_repetition_default_bs16.jsonl"
LMCACHE = "lmcache_multi_round_qa_example_bs16.jsonl"
BLOCK_BYTES = 16 * 23_040


@pytest.mark.parametrize("name, mode, pool", [(VLLM, "order", 40), (LMCACHE, "order", 400), (LMCACHE, "timed", 400)])
def test_a_disk_that_holds_everything_gives_the_unbounded_pool_hit_rate(load, run, name, mode, pool) -> None:
    trace = load(name)
    unbounded = run(trace, mode=mode)
    tiered = run(trace, mode=mode, capacity_blocks=pool, disk_capacity_bytes=10**12)
    pool_only = run(trace, mode=mode, capacity_blocks=pool)
    assert tiered.token_hit_rate == unbounded.token_hit_rate > pool_only.token_hit_rate
    assert tiered.pool_token_hit_rate + tiered.disk_token_hit_rate == pytest.approx(tiered.token_hit_rate)
    assert tiered.disk_token_hit_rate > 0 and tiered.disk_evictions == 0


def test_a_larger_disk_never_hits_less(load, run) -> None:
    trace = load(LMCACHE)
    rates = [run(trace, capacity_blocks=400, disk_capacity_bytes=blocks * BLOCK_BYTES).token_hit_rate
             for blocks in (64, 256, 1024, 4096)]
    assert rates == sorted(rates) and rates[0] < rates[-1]


def test_the_simulated_tier_evicts_what_the_disk_store_evicts(tmp_path) -> None:
    """The same writes and loads on a real DiskStore and on the simulator's tier leave the same blocks."""
    blocks = chain(40)
    size = len(encode(blocks[0]))
    store, sim = DiskStore(str(tmp_path), 10 * size, SPEC, rescan_seconds=1e9), SimTier(10 * size, size)
    for i, b in enumerate(blocks):
        store.store(b)
        sim.store(b.block_hash)
        if i % 3 == 0:  # a load of an older block refreshes it in both
            old = blocks[i // 2]
            assert sim.load_following([old.block_hash]) == int(store.load(expected(old)) is not None)
    assert [b.block_hash in sim.index for b in blocks] == [store.contains(b.block_hash) for b in blocks]


@pytest.mark.slow
def test_the_cli_reports_each_tier_in_text_json_and_a_plot(traces_dir, tmp_path) -> None:
    out, png = tmp_path / "runs.json", tmp_path / "hit.png"
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "simulate", str(traces_dir / LMCACHE), "--mode", "order",
                        "--capacity", "1024,4096", "--disk-capacity", "1GiB", "--no-progress", "--json", str(out),
                        "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "hit(pool)" in r.stdout and "hit(disk)" in r.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [run["disk_capacity_bytes"] for run in runs] == [2**30, 2**30]
    for run in runs:
        assert run["pool_token_hit_rate"] + run["disk_token_hit_rate"] == pytest.approx(run["token_hit_rate"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, "-m", "kvprefix.cli", "simulate", str(traces_dir / LMCACHE),
                          "--disk-capacity", "lots"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--disk-capacity" in bad.stderr

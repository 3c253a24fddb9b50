"""`kvprefix serve --kv-disk`: a prefix one server computed is served from disk by the next server on the same
directory (counted as cached, the same greedy output as a cold server); a corrupted object is a miss, counted,
with the right output; a path that cannot hold a tier refuses to start in one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from support.servers import greedy_tokens, start_server, stop_server

from kvprefix.cache import BlockIdentity
from kvprefix.tiers import disk_layout as layout

pytestmark = pytest.mark.slow
rng = random.Random(11)
PREFIX = [rng.randrange(3, 700) for _ in range(1000)]  # 62 full blocks, then 8 tokens
QUESTIONS = [[rng.randrange(3, 700) for _ in range(30)] for _ in range(3)]


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)  # inside the payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_new_server_serves_the_prefix_from_disk(tmp_path, default_model_dir) -> None:
    tier = tmp_path / "tier"
    cold = start_server(tmp_path)
    try:
        expected = [greedy_tokens(cold, PREFIX + q)[0] for q in QUESTIONS[1:]]
        identity = BlockIdentity.from_dict(cold.get("/v1/models").json()["data"][0]["kvprefix"]["block_identity"])
    finally:
        stop_server(cold)
    first = start_server(tmp_path, "--kv-disk", str(tier), "--kv-disk-size", "1GiB")
    try:
        greedy_tokens(first, PREFIX + QUESTIONS[0])
    finally:
        stop_server(first)  # a graceful stop finishes the queued writes
    second = start_server(tmp_path, "--kv-disk", str(tier), request_log=True)
    try:
        detail: list = []
        tokens, cached = greedy_tokens(second, PREFIX + QUESTIONS[1], detail)
        assert (tokens, cached) == (expected[0], 62 * 16)
        assert detail[0]["cached_tokens_from"] == {"pool": 0, "disk": 62 * 16}
        # The first server's prompt: the shared prefix now from the pool, its own two blocks still on disk.
        (hit,) = greedy_tokens(second, PREFIX + QUESTIONS[0], detail)[1:]
        assert hit == 64 * 16 and detail[1]["cached_tokens_from"] == {"pool": 62 * 16, "disk": 2 * 16}
        m = second.metrics()
        assert m["kvprefix:kv_tier_hit_tokens_total{disk}"] == 64 * 16
        assert m["kvprefix:kv_tier_lookups_total{disk}"] >= 1
    finally:
        stop_server(second)
    logged = [json.loads(line) for line in second.request_log.read_text().splitlines()]
    assert [r["disk_cached_tokens"] for r in logged] == [62 * 16, 2 * 16]
    hashes = identity.hasher().hash_blocks(PREFIX[: 62 * 16])
    flip_byte(layout.object_path(str(tier), hashes[40]))
    third = start_server(tmp_path, "--kv-disk", str(tier))
    try:
        tokens, cached = greedy_tokens(third, PREFIX + QUESTIONS[2])
        assert (tokens, cached) == (expected[1], 40 * 16)
        assert third.metrics()["kvprefix:kv_tier_verify_failures_total{checksum,disk}"] == 1
    finally:
        stop_server(third)


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_a_path_that_cannot_hold_a_tier_refuses_to_start_in_one_line(tmp_path, kind) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    arg = str(path) if kind == "file" else "/proc/kvprefix-tier"
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "serve", "--kv-disk", arg], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--kv-disk" in r.stderr and arg in r.stderr


def test_a_bad_size_is_refused(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "serve", "--kv-disk", str(tmp_path),
                        "--kv-disk-size", "lots"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--kv-disk-size" in r.stderr and "'lots'" in r.stderr


def test_kill_9_during_heavy_writes_leaves_a_tier_that_verifies_within_budget(tmp_path, default_model_dir) -> None:
    tier, budget = tmp_path / "tier", 3 * 2**20  # about 45 of the test model's blocks
    server = start_server(tmp_path, "--kv-disk", str(tier), "--kv-disk-size", str(budget))
    prompts = [[rng.randrange(3, 700) for _ in range(1500)] for _ in range(6)]
    try:
        for p in prompts[:2]:
            greedy_tokens(server, p)
        with server.client() as client:
            for p in prompts[2:]:  # still computing and writing when the kill comes
                try:
                    client.completions.create(model="default-model-v1", prompt=p, max_tokens=1, timeout=0.3)
                except Exception:  # noqa: BLE001  (the timeout: the request goes on in the server)
                    pass
    finally:
        server.proc.kill()  # SIGKILL: queued writes are lost, a write in progress is cut
        server.proc.wait()
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "cache", "verify", str(tier), "--json"],
                       capture_output=True, text=True, timeout=120)
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["ok"] == report["checked"] > 0, report
    assert report["bytes"] <= budget + 70_000  # within one object of the budget
    again = start_server(tmp_path, "--kv-disk", str(tier))
    try:
        _, cached = greedy_tokens(again, prompts[1] + [5, 6, 7])
        m = again.metrics()
        assert cached % 16 == 0 and cached == m["kvprefix:kv_tier_hit_tokens_total{disk}"]
        assert not any(k.startswith("kvprefix:kv_tier_verify_failures_total") and v for k, v in m.items())
    finally:
        stop_server(again)


def test_two_servers_on_one_directory_under_load(tmp_path, default_model_dir) -> None:
    """Concurrent writers of the same blocks, readers of each other's objects, evictions: the same greedy outputs
    on both, no object that fails to verify."""
    import concurrent.futures

    tier, budget = tmp_path / "tier", 4 * 2**20
    servers = [start_server(tmp_path, "--kv-disk", str(tier), "--kv-disk-size", str(budget)) for _ in range(2)]
    prefixes = [[rng.randrange(3, 700) for _ in range(400)] for _ in range(3)]
    prompts = [p + [rng.randrange(3, 700) for _ in range(8)] for p in prefixes for _ in range(4)]
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = [list(pool.map(lambda p, s=s: greedy_tokens(s, p)[0], prompts)) for s in servers]
        assert outs[0] == outs[1]  # the same greedy tokens whichever server, whatever it loaded from the other
        for s in servers:
            m = s.metrics()
            assert not any(k.startswith("kvprefix:kv_tier_verify_failures_total") and v for k, v in m.items())
    finally:
        for s in servers:
            stop_server(s)
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "cache", "verify", str(tier), "--json"],
                       capture_output=True, text=True, timeout=120)
    report = json.loads(r.stdout)
    # One budget for the directory (each server rescans before evicting), give or take a write in flight each.
    assert r.returncode == 0 and report["checked"] > 0 and report["bytes"] <= budget + 2 * 70_000

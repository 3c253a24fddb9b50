"""`kvprefix serve --kv-shared`: two replicas on one real Redis — a prefix replica A computed is replica B's cached
tokens on its first request (from the shared tier, the same greedy output as a cold server); a prefix both receive
at the same moment is computed by one of them (claims); Redis killed,
restarted empty and stopped for good under a serving replica: no request fails, outputs stay right, the counters
say what happened; with a disk tier too, each tier is asked for what the one before lacks and blocks loaded from
the shared tier reach the disk; options that cannot be used refuse to start in one line (with tenants, a Redis off loopback
without a password: fail closed)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.redis_server import RedisServer, needs_redis
from support.servers import greedy_tokens, start_server, stop_server

pytestmark = needs_redis
rng = random.Random(25)
PREFIX = [rng.randrange(3, 700) for _ in range(1000)]  # 62 full blocks, then 8 tokens
QUESTIONS = [[rng.randrange(3, 700) for _ in range(30)] for _ in range(4)]


def wait_stored(server, blocks: int) -> None:
    """Until the replica's write-behind has written ``blocks`` blocks to the shared tier."""
    deadline = time.monotonic() + 30
    while server.metrics().get("kvprefix:kv_tier_stores_total{shared}", 0) < blocks:
        assert time.monotonic() < deadline, "the shared tier's writes did not land"
        time.sleep(0.1)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru").start()
    yield server
    server.stop()


@pytest.mark.slow
def test_a_prefix_one_replica_computed_is_cached_on_another(tmp_path, default_model_dir, redis_server) -> None:
    cold = start_server(tmp_path)
    a = start_server(tmp_path, "--kv-shared", redis_server.url)
    b = start_server(tmp_path, "--kv-shared", redis_server.url, request_log=True)
    try:
        expected = [greedy_tokens(cold, PREFIX + q)[0] for q in QUESTIONS[:2]]
        assert greedy_tokens(a, PREFIX + QUESTIONS[0]) == (expected[0], 0)
        wait_stored(a, 64)
        detail: list = []
        assert greedy_tokens(b, PREFIX + QUESTIONS[1], detail) == (expected[1], 62 * 16)
        assert detail[0]["cached_tokens_from"] == {"pool": 0, "shared": 62 * 16}
        m = b.metrics()
        assert m["kvprefix:kv_tier_hit_tokens_total{shared}"] == 62 * 16
        assert m["kvprefix:kv_tier_hit_blocks_total{shared}"] == 62
        assert not any(k.startswith(("kvprefix:kv_tier_verify_failures_total", "kvprefix:kv_tier_failures_total"))
                       and v for k, v in m.items())
        with redis_server.client() as c:  # every key is the replicas' prefix, namespace id and a block hash (and
            # ":claim" for a block being computed: b's own last blocks, until its write-behind writes them)
            assert all(k.startswith(b"kvprefix:") and len(k.removesuffix(b":claim").split(b":")) == 3
                       for k in c.keys("*"))
    finally:
        for s in (cold, a, b):
            stop_server(s)
    logged = [json.loads(line) for line in b.request_log.read_text().splitlines()]
    assert [r["shared_cached_tokens"] for r in logged] == [62 * 16]


@pytest.mark.slow
def test_a_prefix_two_replicas_receive_at_once_is_computed_once(tmp_path, default_model_dir, redis_server) -> None:
    cold = start_server(tmp_path)
    try:
        expected = [greedy_tokens(cold, PREFIX + q)[0] for q in QUESTIONS[:2]]
    finally:
        stop_server(cold)
    replicas = [start_server(tmp_path, "--kv-shared", redis_server.url) for _ in range(2)]
    try:
        together = threading.Barrier(2)

        def send(i: int) -> tuple[list[str], int]:
            together.wait()
            return greedy_tokens(replicas[i], PREFIX + QUESTIONS[i])

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(send, range(2)))
        assert [tokens for tokens, _ in results] == expected
        assert sorted(cached for _, cached in results) == [0, 62 * 16]  # one computed the prefix, one loaded it
        m = [r.metrics() for r in replicas]
        # The one that computed claimed its 64 full blocks; the other its own 2 (it found the prefix's claimed,
        # waited and loaded them, or found them written already), and any of the prefix's whose write and claim's
        # end fell between one of its lookups and its claims (it loads those all the same).
        claims = sorted(x["kvprefix:kv_tier_claims_total{shared}"] for x in m)
        assert 2 <= claims[0] < 64 and claims[1] == 64
        waits = [x.get("kvprefix:kv_tier_claim_waits_total{loaded,shared}", 0) for x in m]
        assert sum(waits) <= 1 and not any(k.startswith("kvprefix:kv_tier_claim_waits_total{gave_up")
                                           for x in m for k in x)
    finally:
        for r in replicas:
            stop_server(r)


@pytest.mark.slow
def test_redis_killed_restarted_empty_and_stopped_fails_no_request(tmp_path, default_model_dir,
                                                                   redis_server) -> None:
    cold = start_server(tmp_path)
    try:
        prompts = [PREFIX + q for q in QUESTIONS] + [[rng.randrange(3, 700) for _ in range(500)]]
        expected = [greedy_tokens(cold, p)[0] for p in prompts]
    finally:
        stop_server(cold)
    server = start_server(tmp_path, "--kv-shared", redis_server.url, "--num-gpu-blocks", "80")
    try:
        assert greedy_tokens(server, prompts[0])[0] == expected[0]
        wait_stored(server, 64)
        redis_server.kill()  # the pool (80 blocks) still holds the prefix: served from there, writes dropped
        assert greedy_tokens(server, prompts[1])[0] == expected[1]
        assert greedy_tokens(server, prompts[4])[0] == expected[4]  # evicts the prefix from the pool
        m = server.metrics()
        assert m["kvprefix:kv_tier_failures_total{unavailable,shared}"] >= 1
        stored = m["kvprefix:kv_tier_stores_total{shared}"]
        redis_server.start()  # empty, on the same port
        time.sleep(1.5)  # past the backoff
        tokens, cached = greedy_tokens(server, prompts[2])  # nothing shared any more: computed, written again
        assert tokens == expected[2] and cached < 62 * 16
        wait_stored(server, stored + 1)
        with redis_server.client() as c:
            assert c.dbsize() >= 1
        hits = server.metrics()["kvprefix:kv_tier_hit_tokens_total{shared}"]
        redis_server.stop()  # for good
        start = time.monotonic()
        assert greedy_tokens(server, prompts[3])[0] == expected[3]
        assert time.monotonic() - start < 30
        m = server.metrics()
        assert m["kvprefix:kv_tier_hit_tokens_total{shared}"] == hits
        assert m["kvprefix:kv_tier_dropped_writes_total{unavailable,shared}"] >= 1
        assert not any(k.startswith("kvprefix:kv_tier_verify_failures_total") and v for k, v in m.items())
    finally:
        stop_server(server)


@pytest.mark.slow
def test_disk_then_shared_each_asked_for_what_the_one_before_lacks(tmp_path, default_model_dir,
                                                                   redis_server) -> None:
    cold = start_server(tmp_path)
    try:
        expected = [greedy_tokens(cold, PREFIX + q)[0] for q in QUESTIONS[:3]]
    finally:
        stop_server(cold)
    a = start_server(tmp_path, "--kv-disk", str(tmp_path / "disk-a"), "--kv-shared", redis_server.url)
    b_tiers = ("--kv-disk", str(tmp_path / "disk-b"), "--kv-shared", redis_server.url)
    b = start_server(tmp_path, *b_tiers)
    try:
        assert greedy_tokens(a, PREFIX + QUESTIONS[0]) == (expected[0], 0)
        wait_stored(a, 64)
        detail: list = []
        assert greedy_tokens(b, PREFIX + QUESTIONS[1], detail) == (expected[1], 62 * 16)
        assert detail[0]["cached_tokens_from"] == {"pool": 0, "shared": 62 * 16}  # b's disk was empty
        deadline = time.monotonic() + 30  # what b loaded from the shared tier is written to its disk
        while b.metrics().get("kvprefix:kv_tier_stores_total{disk}", 0) < 62:
            assert time.monotonic() < deadline, "the loaded blocks did not reach b's disk"
            time.sleep(0.1)
    finally:
        stop_server(a)
        stop_server(b)
    with redis_server.client() as c:
        c.flushall()  # the shared tier forgets everything: b's restart finds the prefix on its own disk
    b = start_server(tmp_path, *b_tiers)
    try:
        detail = []
        assert greedy_tokens(b, PREFIX + QUESTIONS[2], detail) == (expected[2], 62 * 16)
        assert detail[0]["cached_tokens_from"] == {"pool": 0, "disk": 62 * 16}
        assert b.metrics().get("kvprefix:kv_tier_hit_blocks_total{shared}", 0) == 0
    finally:
        stop_server(b)


@pytest.mark.parametrize("args, words", [
    (["--kv-shared", "http://127.0.0.1:6379/0"], "redis://"),
    (["--kv-shared", "redis://127.0.0.1:6379/x"], "database"),
    (["--kv-shared", "redis://10.1.2.3:6379/0", "--api-key", "k"], "no password"),
    (["--kv-shared", "redis://127.0.0.1:6379/0", "--kv-shared-timeout", "0"], "--kv-shared-timeout"),
])
def test_options_that_cannot_be_used_refuse_to_start_in_one_line(tmp_path, args, words) -> None:
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "serve", *args], capture_output=True, text=True,
                       timeout=120)
    if "--kv-shared-timeout" in args:  # argparse's usage, then its error
        assert r.returncode == 2 and "--kv-shared-timeout" in r.stderr.splitlines()[-1]
        return
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr
    assert "kvprefix serve: --kv-" in r.stderr


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://localhost:6379/0", "redis://:pw@10.1.2.3:6379/1"])
def test_tenants_may_use_a_loopback_or_password_protected_redis(url) -> None:
    from kvprefix.cli import build_parser
    from kvprefix.server.cli import prepare

    engine_args, config = prepare(build_parser().parse_args(["serve", "--api-key", "k", "--kv-shared", url,
                                                             "--kv-shared-timeout", "0.5"]))
    assert (engine_args.kv_shared, engine_args.kv_shared_timeout, config.auth.enabled) == (url, 0.5, True)

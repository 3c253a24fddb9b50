"""The tiers below the pool on the KV event stream of real `kvprefix serve` processes (one real Redis): blocks
written to the disk and to the shared tier are announced with their medium, the disk's evictions are announced
removed, a restarted replica's snapshot holds what its disk holds, a block the shared tier lost is announced
removed once a lookup misses it; the hello says which media a replica has, their sizes and load costs (measured
once a replica has loaded blocks, and in /metrics); and the router's view over those streams credits a replica
that never computed a prefix, but can load it from the shared tier, above a cold replica and below the pool
holder, and sends it the prefix when the pool holder is busy."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
from support.kv_events import Subscriber, cached_tokens, chain, prompt
from support.redis_server import RedisServer, needs_redis
from support.servers import Server, start_server, stop_server

from kvprefix.cache.event_index import StreamMirror
from kvprefix.cache.event_wire import Event
from kvprefix.cache.events import BlockRemoved, BlockStored
from kvprefix.cache.media import DEFAULT_LOAD_COST, DISK, POOL, SHARED
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RouteRequest
from kvprefix.router.policies import Held, make_policy
from kvprefix.tiers import disk_layout as layout

pytestmark = pytest.mark.slow


def read_until(sub: Subscriber, done: Callable[[StreamMirror], bool], timeout: float = 60) -> None:
    """Reads the stream until ``done(mirror)`` (the writes behind the pool land a moment after the answer)."""
    deadline = time.monotonic() + timeout
    while not (sub.mirror.ready and done(sub.mirror)):
        assert time.monotonic() < deadline, f"the stream never got there: {sub.received[-5:]}"
        sub.next()


def held(mirror: StreamMirror, medium: str) -> set[bytes]:
    return set(mirror.blocks.of(medium).blocks())


def events_of(sub: Subscriber, kind: type, medium: str) -> list:
    return [m.event for m in sub.received if isinstance(m, Event) and isinstance(m.event, kind)
            and m.event.medium == medium]


@needs_redis
def test_the_tiers_are_announced_and_credited(tmp_path, default_model_dir) -> None:
    redis = RedisServer(tmp_path, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru").start()
    servers: list[Server] = []
    try:
        a = start_server(tmp_path, "--kv-disk", str(tmp_path / "disk-a"), "--kv-shared", redis.url)
        b = start_server(tmp_path, "--kv-shared", redis.url)
        c = start_server(tmp_path)  # no tier: cold for anything it did not compute
        servers = [a, b, c]
        subs = [Subscriber(s) for s in servers]
        sa, sb, sc = subs
        for sub in subs:
            sub.until(sub.hello.seq)
        media = [{m.name: m for m in s.hello.media} for s in subs]
        assert [list(m) for m in media] == [[POOL, DISK, SHARED], [POOL, SHARED], [POOL]]
        assert media[0][SHARED].store == media[1][SHARED].store != ""
        assert media[0][DISK].capacity_blocks > 1000 and media[0][SHARED].capacity_blocks > 100
        assert media[0][DISK].load_cost == media[1][SHARED].load_cost == DEFAULT_LOAD_COST  # nothing loaded yet

        # A computes a prompt: its blocks are announced in its pool, then written to its disk and the shared tier.
        tokens = prompt(3)
        hashes = chain(sa.hello, tokens)[:10]  # the full blocks before the last token's
        assert cached_tokens(a, tokens) == 0
        read_until(sa, lambda m: set(hashes) <= held(m, DISK) & held(m, SHARED))
        assert set(hashes) <= held(sa.mirror, POOL)
        disk_events = events_of(sa, BlockStored, DISK)
        assert disk_events[0].block_hashes[0] == hashes[0] and disk_events[0].parent_block_hash == sa.hello.root
        assert disk_events[0].namespace == events_of(sa, BlockStored, POOL)[0].namespace

        # The router's view over the three streams: A's pool, then B (which reads the store A wrote to), then C.
        view = FleetView([Replica(s.url, True, mirror=sub.mirror) for s, sub in zip(servers, subs, strict=True)])
        request = RouteRequest(tuple(chain(sa.hello, tokens)), None, num_blocks=-(-len(tokens) // 16))
        credit = [view.held_prefix(r, request.block_hashes) for r in range(3)]
        assert credit[0].pool == 10 and credit[1] == Held(shared=10, shared_cost=DEFAULT_LOAD_COST)
        assert credit[2] == Held() and credit[0].credit > credit[1].credit > credit[2].credit == 0
        policy = make_policy("kv-events")
        assert policy.choose(request, view).replica == 0
        view.replicas[0].outstanding.add([], 4)  # A busy prefilling: the prefix goes where it loads, not to C
        decision = policy.choose(request, view)
        assert (decision.replica, decision.credited) == (1, 10)

        # B loads it from the shared tier: its load cost is measured, in /metrics and the next hello.
        assert cached_tokens(b, tokens) == 10 * 16
        cost = b.metrics()["kvprefix:kv_tier_load_cost{shared}"]
        assert 0.01 <= cost <= 1.0 and cost != DEFAULT_LOAD_COST
        again = Subscriber(b)
        assert {m.name: m for m in again.hello.media}[SHARED].load_cost == pytest.approx(cost, rel=0.5)
        again.close()

        # A block the shared tier lost (another client flushed it) is announced removed when a lookup misses it.
        other = prompt(5)
        cached_tokens(b, other)
        other_hashes = chain(sb.hello, other)[:10]
        read_until(sb, lambda m: set(other_hashes) <= held(m, SHARED))
        with redis.client() as client:
            client.flushall()
        assert b.post("/reset_prefix_cache", {}, params={"wait": "true"}).status_code == 200
        assert cached_tokens(b, other) == 0  # nowhere now: computed, and written to the tier again
        read_until(sb, lambda m: events_of(sb, BlockRemoved, SHARED) != [] and set(other_hashes) <= held(m, SHARED))
        assert events_of(sb, BlockRemoved, SHARED)[0].block_hashes == [other_hashes[0]]
        assert not held(sc.mirror, DISK) and not held(sc.mirror, SHARED)  # C announced no tier at all
    finally:
        for s in servers:
            stop_server(s)
        redis.stop()


def test_the_disk_announces_its_evictions_and_a_restart_snapshots_what_it_holds(tmp_path, default_model_dir) -> None:
    disk = tmp_path / "disk"
    server = start_server(tmp_path, "--kv-disk", str(disk), "--kv-disk-size", "2MiB")
    try:
        sub = Subscriber(server)
        sub.until(sub.hello.seq)
        capacity = {m.name: m for m in sub.hello.media}[DISK].capacity_blocks
        assert 5 <= capacity <= 40, capacity  # the test model's blocks are about 85 KB each
        written: list[bytes] = []
        for base in range(8, 8 + 2 + capacity // 10):  # 10 blocks each: more than the disk holds
            tokens = prompt(base)
            cached_tokens(server, tokens)
            written += chain(sub.hello, tokens)[:10]
            read_until(sub, lambda m, w=list(written): set(w[-10:]) <= held(m, DISK) | set(removed(sub)))
        read_until(sub, lambda m: len(held(m, DISK)) <= capacity and removed(sub))
        on_disk = held(sub.mirror, DISK)
        assert set(removed(sub)) == set(written) - on_disk
        files = {e.block_hash for e in layout.scan(str(disk))}
        assert on_disk == files
        sub.close()
    finally:
        stop_server(server)
    restarted = start_server(tmp_path, "--kv-disk", str(disk), "--kv-disk-size", "2MiB")
    try:
        fresh = Subscriber(restarted)
        fresh.until(fresh.hello.seq)
        assert held(fresh.mirror, DISK) == files and not held(fresh.mirror, POOL)  # found by the start-up scan
        assert os.path.isdir(disk / "objects")
    finally:
        stop_server(restarted)


def removed(sub: Subscriber) -> list[bytes]:
    return [h for e in events_of(sub, BlockRemoved, DISK) for h in e.block_hashes]

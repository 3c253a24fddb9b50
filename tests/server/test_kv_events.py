"""`GET /v1/kv_events` on real `kvprefix serve` processes, read by a real HTTP client into a StreamMirror (which
fails on any skipped or repeated sequence number). A 48-block pool, so that evictions happen."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from support.kv_events import Subscriber, cached_tokens, chain, prompt
from support.server_registry import shared_server
from support.servers import ADMIN, ADMIN_KEY, Server, start_server

from kvprefix.cache import AllBlocksCleared, BlockRemoved, BlockStored, namespace_id
from kvprefix.cache.event_wire import Event, Goodbye, SnapshotStart

pytestmark = pytest.mark.slow

POOL = ("--num-gpu-blocks", "48")


events_server = shared_server("events_server", *POOL, "--replica-id", "replica-e2e", scope="module")


@pytest.fixture
def listener(events_server: Server) -> Iterator[Subscriber]:
    """A subscriber that listens all along (from before the test's requests)."""
    sub = Subscriber(events_server)
    sub.until(sub.hello.seq)
    yield sub
    sub.close()


def assert_index_predicts_hits(sub: Subscriber, server: Server, prompts: list[list[int]]) -> set[int]:
    """Each prompt's cached tokens, as the mirror predicts them just before it is sent, equal what the engine
    reports: the event-fed index is the engine's cache. Returns the predicted block counts."""
    predicted = set()
    for tokens in prompts:
        sub.sync(server)
        blocks = sub.mirror.index.cached_prefix_blocks(chain(sub.hello, tokens)[: (len(tokens) - 1) // 16])
        assert cached_tokens(server, tokens) == blocks * 16
        predicted.add(blocks)
    return predicted


def test_stored_events_name_the_namespace_and_chain_from_the_root(events_server: Server, listener: Subscriber):
    hello = listener.hello
    assert (hello.replica_id, hello.block_size, hello.hash_algo) == ("replica-e2e", 16, "sha256")
    tokens = prompt(1)
    cached_tokens(events_server, tokens)
    listener.sync(events_server)
    stored = [e for e in listener.events() if isinstance(e.event, BlockStored)]
    hashes = chain(hello, tokens)
    first = next(e for e in stored if e.event.block_hashes[0] == hashes[0])
    assert first.event.parent_block_hash == hello.root
    assert first.event.namespace == namespace_id(hello.root)
    assert first.event.block_size == 16 and first.replica_id == "replica-e2e"
    assert [h for e in stored for h in e.event.block_hashes] == hashes  # every full block, prompt and output
    seqs = [e.seq for e in listener.events()]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_eviction_is_a_removal_and_the_index_predicts_every_hit(events_server: Server, listener: Subscriber):
    prompts = [prompt(base) for base in range(10, 17)]  # 7 x 10 blocks in a 48-block pool
    for tokens in prompts:
        cached_tokens(events_server, tokens)
    listener.sync(events_server)
    removed = {h for e in listener.events() if isinstance(e.event, BlockRemoved) for h in e.event.block_hashes}
    assert removed & set(chain(listener.hello, prompts[0]))  # the oldest prompt was evicted
    predicted = assert_index_predicts_hits(listener, events_server, prompts[::-1])
    assert {0, 10} <= predicted  # both full hits and evicted prompts were checked


def test_reset_is_all_cleared(events_server: Server, listener: Subscriber):
    cached_tokens(events_server, prompt(30))
    assert events_server.post("/reset_prefix_cache").json()["success"]
    listener.sync(events_server)
    assert isinstance(listener.events()[-1].event, AllBlocksCleared)
    assert len(listener.mirror.index) == 0
    fresh = Subscriber(events_server)
    assert fresh.next() == SnapshotStart(fresh.hello.seq, 0)
    fresh.close()


def test_reconnect_with_since_gets_exactly_the_missed_events(events_server: Server, listener: Subscriber):
    gone = Subscriber(events_server)
    gone.until(gone.hello.seq)
    since, epoch = gone.mirror.since, gone.mirror.epoch
    gone.close()
    for base in (40, 41, 42):
        cached_tokens(events_server, prompt(base))
    back = Subscriber(events_server, mirror=gone.mirror, since=since, epoch=epoch)
    assert back.hello.resume and back.hello.seq > since
    back.until(back.hello.seq)
    listener.until(back.hello.seq)
    assert back.events() == [e for e in listener.events() if since < e.seq <= back.hello.seq]
    assert back.mirror.index.blocks() == listener.mirror.index.blocks()
    back.close()


@pytest.mark.parametrize("resume", [{"since": 0, "epoch": "0123456789abcdef"}, {"since": 0}, {"epoch": "x"},
                                    {"since": 10**9, "epoch": None}])
def test_a_resume_that_cannot_be_served_gets_a_snapshot_of_the_cache(events_server: Server, listener: Subscriber,
                                                                     resume: dict):
    for base in (50, 51, 52, 53, 54):
        cached_tokens(events_server, prompt(base))
    if "epoch" in resume and resume["epoch"] is None:  # the right epoch, a number it never reached
        resume = {**resume, "epoch": listener.mirror.epoch}
    sub = Subscriber(events_server, **resume)
    assert not sub.hello.resume
    sub.until(sub.hello.seq)
    assert any(isinstance(m, SnapshotStart) for m in sub.received)
    listener.until(sub.hello.seq)
    assert sub.mirror.index.blocks() == listener.mirror.index.blocks() and len(sub.mirror.index) > 0
    # ... and the live stream continues from the snapshot without a gap.
    cached_tokens(events_server, prompt(55))
    seq = sub.sync(events_server)
    listener.until(seq)
    assert sub.mirror.index.blocks() == listener.mirror.index.blocks()
    sub.close()


def test_a_stalled_subscriber_does_not_stall_generation(events_server: Server, listener: Subscriber):
    url = urlparse(events_server.url)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect((url.hostname, url.port))
    stalled.sendall(f"GET /v1/kv_events HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode())
    try:
        start = time.monotonic()
        for base in range(60, 90):
            cached_tokens(events_server, prompt(base))  # never read: the stalled stream must not hold these up
        assert time.monotonic() - start < 60
        predicted = assert_index_predicts_hits(listener, events_server, [prompt(89), prompt(60)])
        assert predicted == {10, 0}
    finally:
        stalled.close()


def test_events_need_the_admin_key_when_tenants_exist(tenant_server_process: Server):
    tenant_server = tenant_server_process  # the event stream is read over a socket (support/kv_events.py)
    url = tenant_server.url + "/v1/kv_events"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer key-alice"}, timeout=10).status_code == 401
    sub = Subscriber(tenant_server, headers=ADMIN)
    sub.until(sub.hello.seq)
    tokens = prompt(100, 40)
    for key in ("key-alice", "key-bob"):
        cached_tokens(tenant_server, tokens, headers={"authorization": f"Bearer {key}"})
    sub.sync(tenant_server, headers=ADMIN)
    firsts = [e.event for e in sub.events() if isinstance(e.event, BlockStored)
              and e.event.parent_block_hash not in sub.mirror.index]
    # Two tenants, two namespaces, neither the shared one; the wire names them by id, never by tenant or salt.
    namespaces = {e.namespace for e in firsts[-2:]}
    assert len(namespaces) == 2 and namespace_id(sub.hello.root) not in namespaces
    text = json.dumps([str(m) for m in sub.received])
    assert "alice" not in text and "bob" not in text
    sub.close()


def test_events_are_refused_with_tenants_and_no_admin_key(tenants_without_admin: Server):
    for headers in ({}, {"authorization": "Bearer key-alice"}, {"authorization": f"Bearer {ADMIN_KEY}"}):
        r = httpx.get(tenants_without_admin.url + "/v1/kv_events", headers=headers, timeout=10)
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


def test_first_snapshot_covers_blocks_cached_before_anyone_listened_and_shutdown_ends_streams(server_tmp: Path):
    server = start_server(server_tmp, *POOL)
    try:
        prompts = [prompt(base) for base in range(120, 126)]  # evicts too, before any subscriber
        for tokens in prompts:
            cached_tokens(server, tokens)
        first = Subscriber(server)
        first.until(first.hello.seq)
        assert len(first.mirror.index) > 0
        assert {0, 10} <= assert_index_predicts_hits(first, server, prompts[::-1])
        server.proc.terminate()
        start = time.monotonic()
        while not isinstance(msg := first.next(), Goodbye):
            assert isinstance(msg, Event)
        assert msg.reason == "shutdown" and msg.seq == first.mirror.since
        first.close()
        assert server.proc.wait(timeout=30) in (0, -15)
        assert time.monotonic() - start < 20  # the open stream did not hold the server until uvicorn's deadline
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "Traceback" not in server.log_path.read_text(), server.log_path.read_text()

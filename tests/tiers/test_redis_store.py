"""The shared tier on a real `redis-server`: one key per whole object written once, a run looked up in one
pipelined round trip, every load verified (corrupt and foreign values another client wrote are counted misses,
deleted), TTLs, the server's settings read at start, and a server down, killed, restarted empty, stopped or full:
misses and dropped writes, counted, never an exception, never a wait past the timeout."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
from support.redis_server import RedisServer, needs_redis
from support.servers import free_port
from support.tier_blocks import SPEC, chain, expected

from kvprefix.tiers.objects import encode
from kvprefix.tiers.redis_store import RedisStore, parse_url
from kvprefix.tiers.write_behind import WriteBehind

pytestmark = needs_redis
FAST = dict(timeout=0.2, backoff=0.05, max_backoff=0.05)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def fresh(redis_server):
    """The module's server, emptied."""
    with redis_server.client() as c:
        c.flushall()
    return redis_server


@pytest.fixture
def own_server(tmp_path):
    """A server of the test's own, to kill, pause or restart."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def spans_for(obj) -> list[memoryview]:
    half = len(obj.payload) // 2
    return [memoryview(bytearray(half)), memoryview(bytearray(len(obj.payload) - half))]


def test_blocks_round_trip_under_one_key_each(fresh) -> None:
    blocks = chain(6)
    store = RedisStore(fresh.url, SPEC, **FAST)
    assert all(store.store(b) for b in blocks[:4])
    assert store.lookup([b.block_hash for b in blocks], blocks[0].namespace) == 4
    assert store.lookup([blocks[4].block_hash] + [b.block_hash for b in blocks[:4]], blocks[0].namespace) == 0
    assert [store.load(expected(b)) for b in blocks[:4]] == blocks[:4]
    spans = spans_for(blocks[2])
    assert store.load_into(expected(blocks[2]), spans)
    assert b"".join(bytes(s) for s in spans) == blocks[2].payload
    assert store.load(expected(blocks[4])) is None and not store.load_into(expected(blocks[5]), spans_for(blocks[5]))
    size = len(encode(blocks[0]))
    assert (store.stats.stores, store.stats.bytes_written) == (4, 4 * size)
    assert (store.stats.hit_blocks, store.stats.bytes_read) == (5, 5 * size)
    assert sum(store.stats.verify_failures.values()) == sum(store.stats.failures.values()) == 0
    with fresh.client() as c:  # one key per block holding the whole object; the key names namespace id and hash
        keys = sorted(k.decode() for k in c.keys("*"))
        assert keys == sorted(f"kvprefix:{b.namespace}:{b.block_hash.hex()}" for b in blocks[:4])
        assert c.get(keys[0]) in [encode(b) for b in blocks[:4]]


def test_another_namespace_and_another_prefix_do_not_see_the_blocks(fresh) -> None:
    blocks = chain(3)
    RedisStore(fresh.url, SPEC, **FAST).store(blocks[0])
    assert RedisStore(fresh.url, SPEC, key_prefix="other:", **FAST).lookup([blocks[0].block_hash], blocks[0].namespace) == 0
    assert RedisStore(fresh.url, SPEC, **FAST).lookup([blocks[0].block_hash], "f" * 16) == 0


def test_a_block_is_written_once(fresh) -> None:
    (block,) = chain(1)
    store = RedisStore(fresh.url, SPEC, **FAST)
    assert store.store(block)
    other = dataclasses.replace(block, payload=bytes(len(block.payload)))
    assert store.store(other)  # already there: left as it is
    assert store.load(expected(block)) == block
    assert store.stats.stores == 1


def test_objects_carry_the_ttl_asked_for(fresh) -> None:
    a, b, c = chain(3)
    store = RedisStore(fresh.url, SPEC, ttl=3600, **FAST)
    store.store(a)
    store.store(b, retain_until=time.time() + 60)
    RedisStore(fresh.url, SPEC, **FAST).store(c)
    with fresh.client() as client:
        ttls = [client.ttl(store.key(x.namespace, x.block_hash)) for x in (a, b, c)]
    assert 3590 < ttls[0] <= 3600 and 50 < ttls[1] <= 60 and ttls[2] == -1


def test_claims_go_to_the_first_replica_and_end_with_the_write(fresh) -> None:
    blocks = chain(4)
    hashes, ns = [b.block_hash for b in blocks], blocks[0].namespace
    a, b = RedisStore(fresh.url, SPEC, **FAST), RedisStore(fresh.url, SPEC, **FAST)  # two replicas
    assert a.claim(hashes[:2], ns, 30) == 0  # a computes blocks 0 and 1
    assert a.claim(hashes[:2], ns, 30) == 0  # its own claims stand in nobody's way of its own
    assert b.claim(hashes, ns, 30) == 2  # b waits for 0 and 1, and claims 2 and 3 to compute them
    assert a.claim(hashes[1:], ns, 30) == 0 and a.claim(hashes[2:], ns, 30) == 2
    assert (a.stats.claims, b.stats.claims) == (2, 2)
    with fresh.client() as c:  # beside each object's key, never an object key; the namespace id in it, a token
        assert c.get(f"kvprefix:{ns}:{hashes[0].hex()}:claim") == a.token != b.token
        assert 29_000 < c.pttl(a.claim_key(ns, hashes[0])) <= 30_000
    assert a.store(blocks[0])  # written: its claim is gone in the same round trip
    with fresh.client() as c:
        assert c.exists(a.claim_key(ns, hashes[0])) == 0
    assert b.claim(hashes, ns, 30) == 2  # block 0 written since b's lookup (b loads it), block 1 still a's
    with fresh.client() as c:  # no claim of b's is left on the written block, and none counted
        assert c.exists(b.claim_key(ns, hashes[0])) == 0 and b.stats.claims == 2
    assert b.lookup(hashes, ns) == 1 and b.claim(hashes[1:], ns, 30) == 1
    x, y = chain(2, seed=1)
    with fresh.client() as c:
        c.set(a.claim_key(ns, x.block_hash), b"another", px=1)  # a claim that ran out
        c.rpush(a.claim_key(ns, y.block_hash), b"not a claim")  # a value another client put there
    time.sleep(0.01)
    assert a.claim([x.block_hash, y.block_hash], ns, 30) == 0  # neither stands in anyone's way


def test_claims_are_short_when_asked_and_nothing_while_the_store_is_down(own_server) -> None:
    blocks = chain(2)
    hashes, ns = [b.block_hash for b in blocks], blocks[0].namespace
    a, b = RedisStore(own_server.url, SPEC, **FAST), RedisStore(own_server.url, SPEC, **FAST)
    assert a.claim(hashes, ns, 0.05) == 0 and b.claim(hashes, ns, 30) == 2
    time.sleep(0.1)  # a's claims ran out (a replica that died): b's are won
    assert b.claim(hashes, ns, 30) == 0 and a.claim(hashes, ns, 30) == 2
    own_server.pause()
    try:
        start = time.monotonic()
        assert a.claim(hashes, ns, 30) == 0 and a.claim(hashes, ns, 30) == 0  # a timeout, then the backoff
        assert time.monotonic() - start < 1 and a.stats.failures == {"timeout": 1}
    finally:
        own_server.resume()
    own_server.kill()
    assert RedisStore(own_server.url, SPEC, **FAST).claim(hashes, ns, 30) == 0


def corrupted(kind: str, block, other) -> bytes:
    data = bytearray(encode(block))
    if kind == "bit flip":
        data[len(data) // 2] ^= 0x40
    elif kind == "truncated":
        del data[-100:]
    elif kind == "foreign":
        return b"not an object of ours"
    elif kind == "another block's object":
        return encode(other)
    elif kind == "another model":
        return encode(dataclasses.replace(block, spec=dataclasses.replace(SPEC, model="another")))
    elif kind == "another namespace":
        return encode(dataclasses.replace(block, namespace="f" * 16))
    return bytes(data)


@pytest.mark.parametrize("kind, reason", [("bit flip", "checksum"), ("truncated", "truncated"), ("foreign", "magic"),
                                          ("another block's object", "chain"), ("another model", "identity"),
                                          ("another namespace", "namespace"), ("a list", "type")])
@pytest.mark.parametrize("how", ["load", "load_into"])
def test_values_another_client_wrote_are_counted_misses(fresh, kind, reason, how) -> None:
    block, other = chain(2)
    store = RedisStore(fresh.url, SPEC, **FAST)
    key = store.key(block.namespace, block.block_hash)
    with fresh.client() as c:
        if kind == "a list":
            c.rpush(key, encode(block))
        else:
            c.set(key, corrupted(kind, block, other))
        spans = spans_for(block)
        before = [bytes(s) for s in spans]
        hit = store.load(expected(block)) if how == "load" else store.load_into(expected(block), spans)
        assert not hit and [bytes(s) for s in spans] == before  # nothing reached the caller's memory
        assert store.stats.verify_failures == {reason: 1} and store.stats.hit_blocks == 0
        assert c.get(key) is None  # deleted: the block is written again when computed
    assert store.store(block) and store.load(expected(block)) == block


def test_down_at_start_is_a_miss_and_a_dropped_write(caplog) -> None:
    (block,) = chain(1)
    start = time.monotonic()
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", SPEC, **FAST)
    assert store.lookup([block.block_hash], block.namespace) == 0
    assert store.load(expected(block)) is None and not store.store(block)
    assert time.monotonic() - start < 2
    assert store.stats.failures["unavailable"] >= 1 and store.stats.dropped_writes["unavailable"] == 1
    assert store.settings == {}


def test_killed_then_restarted_empty_then_stopped(own_server) -> None:
    blocks = chain(4)
    hashes = [b.block_hash for b in blocks]
    ns = blocks[0].namespace
    store = RedisStore(own_server.url, SPEC, **FAST)
    assert all(store.store(b) for b in blocks[:2]) and store.lookup(hashes, ns) == 2
    own_server.kill()
    assert store.lookup(hashes, ns) == 0 and store.load(expected(blocks[0])) is None
    assert not store.store(blocks[2])
    assert store.stats.failures["unavailable"] >= 1 and store.stats.dropped_writes["unavailable"] == 1
    own_server.restart()  # on the same port, empty
    time.sleep(0.1)  # past the backoff: the next call reconnects
    assert store.lookup(hashes, ns) == 0 and store.load(expected(blocks[0])) is None
    assert store.store(blocks[3]) and store.load(expected(blocks[3])) == blocks[3]
    own_server.stop()
    start = time.monotonic()
    assert store.lookup(hashes, ns) == 0 and not store.load_into(expected(blocks[3]), spans_for(blocks[3]))
    assert time.monotonic() - start < 1


def test_a_server_that_does_not_answer_times_out_then_backs_off(own_server) -> None:
    blocks = chain(2)
    store = RedisStore(own_server.url, SPEC, timeout=0.2, backoff=0.5, max_backoff=0.5)
    assert store.store(blocks[0])
    own_server.pause()
    try:
        start = time.monotonic()
        assert store.lookup([blocks[0].block_hash], blocks[0].namespace) == 0
        assert 0.15 < time.monotonic() - start < 1.0
        assert store.stats.failures == {"timeout": 1}
        start = time.monotonic()  # backing off: misses at once, not another timeout
        assert store.load(expected(blocks[0])) is None and not store.store(blocks[1])
        assert time.monotonic() - start < 0.05 and store.stats.failures == {"timeout": 1}
    finally:
        own_server.resume()
    time.sleep(0.6)
    assert store.load(expected(blocks[0])) == blocks[0]


def test_settings_are_read_and_an_unbounded_store_warned_of(fresh, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvprefix.tiers.redis_store"):
        store = RedisStore(fresh.url, SPEC, **FAST)
    assert store.settings["maxmemory"] == "0" and store.max_bytes == 0
    assert "no maxmemory" in caplog.text and "allkeys-lru" in caplog.text


def test_a_full_store_under_noeviction_rejects_writes_counted(tmp_path, caplog) -> None:
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction").start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvprefix.tiers.redis_store"):
            store = RedisStore(server.url, SPEC, **FAST)
        assert store.max_bytes == 2 * 2**20 and "noeviction" in caplog.text
        spec = dataclasses.replace(SPEC, num_layers=64, head_size=64)  # 128 KiB objects
        store.spec = spec
        blocks = chain(40, spec=spec)
        written = [store.store(b) for b in blocks]
        assert written[0] and not written[-1]
        assert store.stats.dropped_writes["rejected"] == written.count(False) and not store.stats.failures
        with server.client() as c:
            c.config_set("maxmemory", "1mb")  # now below what is used: even a claim's few bytes are refused
        assert store.claim([b.block_hash for b in blocks[-2:]], blocks[0].namespace, 30) == 0  # nothing claimed
        assert store.load(expected(blocks[0])) == blocks[0] and not store.stats.failures  # reads go on
    finally:
        server.stop()


def test_a_server_without_config_is_tolerated(tmp_path) -> None:
    server = RedisServer(tmp_path, "--rename-command", "CONFIG", "").start()
    try:
        store = RedisStore(server.url, SPEC, **FAST)
        (block,) = chain(1)
        assert store.settings == {} and store.store(block) and store.load(expected(block)) == block
        assert not store.stats.failures
    finally:
        server.stop()


def test_urls() -> None:
    u = parse_url("rediss://:s3cret@cache.internal:6380/2")
    assert (u.host, u.port, u.db, u.has_password, u.tls, u.loopback) == ("cache.internal", 6380, 2, True, True, False)
    assert "s3cret" not in u.redacted and u.redacted == "rediss://***@cache.internal:6380/2"
    assert parse_url("redis://127.0.0.1").loopback and parse_url("redis://localhost:1/0").port == 1
    for bad in ("http://host:1/0", "redis://:1/0", "redis://host:1/x", "redis://host:port/0"):
        with pytest.raises(ValueError, match="--kv-shared"):
            parse_url(bad)


def test_killed_between_a_lookup_and_its_loads_and_under_queued_writes(own_server) -> None:
    blocks = chain(8)
    ns = blocks[0].namespace
    store = RedisStore(own_server.url, SPEC, **FAST)
    writer = WriteBehind(store, max_queue=16)
    for b in blocks[:4]:
        writer.submit(b)
    writer.flush()
    assert store.lookup([b.block_hash for b in blocks[:4]], ns) == 4
    own_server.kill()  # after the lookup said 4: every load is a miss, no exception, nothing written to the spans
    spans = spans_for(blocks[0])
    assert not store.load_into(expected(blocks[0]), spans) and not any(bytes(spans[0]))
    for b in blocks[4:]:
        writer.submit(b)
    writer.flush()  # the writer thread survives: each queued write dropped, counted
    writer.close()
    assert store.stats.stores == 4 and sum(store.stats.dropped_writes.values()) == 4
    assert store.stats.failures["unavailable"] >= 1 and not store.stats.verify_failures

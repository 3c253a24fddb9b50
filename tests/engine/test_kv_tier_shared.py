"""The shared tier under real engines on one real Redis: a second engine loads the prefix the first computed, counts
it as cached, and its KV bytes are the computed ones; Redis killed, then back empty: misses, counted, and the
outputs stay right; a pool hit is never looked up in the tier; a prefix two engines receive at once is computed by
one (the other waits for its claims, then loads), a claimant that never writes delays a request by at most its
deadline, and a Redis that does not answer makes nobody wait."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from support.engine_kv import block_kv, run
from support.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
rng = random.Random(25)
PREFIX = [rng.randrange(3, 500) for _ in range(200)]  # 12 full 16-token blocks, then 8 tokens
PROMPTS = [PREFIX + [rng.randrange(3, 500) for _ in range(20)] for _ in range(3)]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def test_another_engine_loads_the_prefix_exactly(make_llm, redis_server, assert_no_leaks) -> None:
    cold, _ = run(make_llm(), PROMPTS)
    first = make_llm(kv_shared=redis_server.url)
    assert run(first, PROMPTS[:1])[0] == cold[:1]
    first.llm_engine.kv_tier.flush()
    second = make_llm(kv_shared=redis_server.url)
    tokens, cached = run(second, PROMPTS[1:2])
    assert (tokens, cached) == (cold[1:2], [192])
    m = second.llm_engine.get_metrics()
    assert m["kv_shared_hit_tokens"] == m["prefix_cache_hits"] == 192 and m["kv_shared_failures"] == 0
    for h in second.llm_engine.hasher.hash_blocks(PROMPTS[1][:192]):
        assert torch.equal(block_kv(first, h), block_kv(second, h))  # the bytes computed, not close to them
    lookups = m["kv_shared_lookups"]
    assert run(second, PROMPTS[2:])[1] == [192]  # from the pool now: the tier is asked only past the pool's hits
    assert second.llm_engine.get_metrics()["kv_shared_hit_tokens"] == 192
    assert second.llm_engine.get_metrics()["kv_shared_lookups"] <= lookups + 1
    assert_no_leaks(second)
    first.llm_engine.close()
    second.llm_engine.close()


def test_redis_killed_then_back_empty(make_llm, redis_server) -> None:
    cold, _ = run(make_llm(), PROMPTS)
    first = make_llm(kv_shared=redis_server.url)
    run(first, PROMPTS[:1])
    first.llm_engine.kv_tier.flush()
    redis_server.kill()
    second = make_llm(kv_shared=redis_server.url)  # Redis down at start: starts all the same
    assert run(second, PROMPTS[1:2]) == (cold[1:2], [0])
    m = second.llm_engine.get_metrics()
    assert m["kv_shared_failures_unavailable"] >= 1 and m["kv_shared_hit_tokens"] == 0
    redis_server.start()
    third = make_llm(kv_shared=redis_server.url)
    assert run(third, PROMPTS[2:]) == (cold[2:], [0])  # empty: computed, and written again
    third.llm_engine.kv_tier.flush()
    assert third.llm_engine.get_metrics()["kv_shared_stores"] >= 12
    for llm in (first, second, third):
        llm.llm_engine.close()


def computed(llm) -> int:
    return llm.llm_engine.get_metrics()["prompt_tokens_computed"]


def test_a_prefix_sent_to_two_engines_at_once_is_computed_once(make_llm, redis_server, assert_no_leaks) -> None:
    cold, _ = run(make_llm(), PROMPTS[:2])
    engines = [make_llm(kv_shared=redis_server.url) for _ in range(2)]
    together = threading.Barrier(2)
    results: list = [None, None]

    def send(i: int) -> None:
        together.wait()
        results[i] = run(engines[i], PROMPTS[i : i + 1])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r[0][0] for r in results] == cold  # the same greedy tokens as computing it
    assert sorted(r[1][0] for r in results) == [0, 192]  # one computed the prefix, the other loaded it
    assert sum(computed(e) for e in engines) == 220 + 28
    assert sum(e.llm_engine.get_metrics()["kv_shared_hit_tokens"] for e in engines) == 192  # from the shared tier
    for e in engines:
        assert_no_leaks(e)
        e.llm_engine.close()


def hold_writes(llm) -> threading.Event:
    """Holds the shared tier's writer (before each real write) until the event is set: a replica still computing."""
    store = llm.llm_engine.kv_tier.stores[0]
    release, write = threading.Event(), store.store

    def held(*args, **kwargs):
        release.wait(30)
        return write(*args, **kwargs)

    store.store = held
    return release


def test_a_replica_waits_for_the_blocks_another_claimed_then_loads_them(make_llm, redis_server) -> None:
    cold, _ = run(make_llm(), PROMPTS[:2])
    first, second = make_llm(kv_shared=redis_server.url), make_llm(kv_shared=redis_server.url)
    release = hold_writes(first)
    assert run(first, PROMPTS[:1]) == (cold[:1], [0])  # computed; its blocks claimed, not written yet
    assert first.llm_engine.get_metrics()["kv_shared_claims"] == 13
    result: list = []
    waiting = threading.Thread(target=lambda: result.append(run(second, PROMPTS[1:2])))
    waiting.start()
    waiting.join(0.4)
    assert waiting.is_alive()  # waits for the claimed blocks, well within its deadline (twice 12 blocks at the
    # unmeasured 0.1 s each, + 0.5 s)
    release.set()
    waiting.join(30)
    assert result == [(cold[1:2], [192])]
    m = second.llm_engine.get_metrics()
    assert m["kv_shared_claim_waits_loaded"] == 1 and m["kv_shared_hit_tokens"] == 192
    assert computed(second) == 28 and m["kv_shared_claims"] == 1  # its own last block
    with redis_server.client() as c:  # written: the claims went with the writes
        assert not c.keys("*:claim")
    for llm in (first, second):
        llm.llm_engine.close()


def plant_claims(llm, redis_server, prompt, ms: int) -> None:
    """Claims of the prompt's full blocks by another replica (a token of no engine's), expiring after ``ms``."""
    engine = llm.llm_engine
    store = engine.kv_tier.stores[0]
    with redis_server.client() as c:
        for h in engine.hasher.hash_blocks(prompt[:192]):
            c.set(store.claim_key(engine.hasher.namespace_id, h), b"a dead replica", px=ms)


@pytest.mark.parametrize("ms, outcome", [(60_000, "gave_up"), (200, "unclaimed")])
def test_a_claimant_that_never_writes_delays_a_request_boundedly(make_llm, redis_server, ms, outcome) -> None:
    cold, _ = run(make_llm(), PROMPTS[:1])
    llm = make_llm(kv_shared=redis_server.url)
    run(llm, [PROMPTS[2][-40:]])  # another prompt: its prefill time measured (the tiny model's: microseconds)
    per_block = llm.llm_engine.prefill_seconds_per_block()
    plant_claims(llm, redis_server, PROMPTS[0], ms)
    start = time.monotonic()
    assert run(llm, PROMPTS[:1]) == (cold, [0])  # computed after all
    waited = time.monotonic() - start
    m = llm.llm_engine.get_metrics()
    assert m[f"kv_shared_claim_waits_{outcome}"] == m["kv_shared_claim_waits"] == 1
    if outcome == "gave_up":  # the deadline: twice the 12 blocks' measured compute plus 0.5 s, at least 1 s
        assert max(1.0, 0.5 + 24 * per_block) < waited < 3
    else:  # the claims ran out first: its own, then computed
        assert 0.15 < waited < 0.5 and m["kv_shared_claims"] == 13 + 2
    llm.llm_engine.close()


def test_a_redis_that_does_not_answer_makes_no_request_wait(make_llm, redis_server) -> None:
    cold, _ = run(make_llm(), PROMPTS[:1])
    llm = make_llm(kv_shared=redis_server.url, kv_shared_timeout=0.2)
    plant_claims(llm, redis_server, PROMPTS[0], 60_000)
    redis_server.pause()
    try:
        start = time.monotonic()
        assert run(llm, PROMPTS[:1]) == (cold, [0])
        assert time.monotonic() - start < 1.5  # one timeout, then the backoff: no claim, no wait
    finally:
        redis_server.resume()
    m = llm.llm_engine.get_metrics()
    assert m["kv_shared_failures_timeout"] >= 1 and m["kv_shared_claim_waits"] == m["kv_shared_claims"] == 0
    llm.llm_engine.close()

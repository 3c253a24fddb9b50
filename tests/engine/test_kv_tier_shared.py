"""The shared tier under real engines on one real Redis: a second engine loads the prefix the first computed, counts
it as cached, and its KV bytes are the computed ones; Redis killed, then back empty: misses, counted, and the
outputs stay right; a pool hit is never looked up in the tier."""

from __future__ import annotations

import random

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

"""Round robin over three replicas that share a KV tier on one real Redis: each system prompt is computed once
for the fleet and loaded from the tier by the other replicas, so the token hit rate is within 0.05 of one shared
pool's, where round robin alone (each replica computing each prompt) is far below it."""

from __future__ import annotations

import pytest
from support.redis_server import RedisServer, needs_redis
from support.routers import (
    REPLICA_BLOCKS,
    hit_rate,
    per_replica,
    shared_pool_hit_rate,
    shared_prefix_traffic,
    start_router,
)
from support.servers import start_server, stop_server

pytestmark = [pytest.mark.slow, needs_redis]


def test_round_robin_with_a_shared_tier_hits_like_one_shared_pool(tmp_path, default_model_dir) -> None:
    redis = RedisServer(tmp_path, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru").start()
    replicas, router = [], None
    try:
        args = ("--num-gpu-blocks", str(REPLICA_BLOCKS), "--max-num-seqs", "16", "--kv-shared", redis.url)
        replicas = [start_server(tmp_path, *args) for _ in range(3)]
        router = start_router(tmp_path, [r.url for r in replicas], "round-robin", None)
        traffic = shared_prefix_traffic(rounds=4)
        rate = hit_rate(router, traffic)
        shared = shared_pool_hit_rate(replicas[0], default_model_dir, traffic)
        requests = per_replica(router.metrics(), "requests_total")
        assert sorted(requests.values()) == [8, 8, 8], requests  # round robin: each replica its third
        metrics = [r.metrics() for r in replicas]
        from_tier = sum(m["kvprefix:kv_tier_hit_tokens_total{shared}"] for m in metrics)
        prompt = sum(m["kvprefix:prompt_tokens_total"] for m in metrics)
        print("round robin with the tier", rate, "one shared pool", shared, "from the tier", from_tier / prompt)
        assert rate >= shared - 0.05, (rate, shared)
        # Without the tier these tokens would have been computed: round robin alone is far below.
        assert rate - from_tier / prompt < shared - 0.25, (rate, from_tier, prompt, shared)
        assert not any(k.startswith(("kvprefix:kv_tier_verify_failures_total", "kvprefix:kv_tier_failures_total"))
                       and v for m in metrics for k, v in m.items())
    finally:
        for s in ([router] if router else []) + replicas:
            stop_server(s)
        redis.stop()

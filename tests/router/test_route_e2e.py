"""`kvprefix route` end to end: three real replicas, real routers, the official openai client.

Hit rates are the replicas' own (usage.prompt_tokens_details.cached_tokens). The bound "one shared pool" is the
planner's replay of the same requests (the same hashes) on one real ``KVCacheManager`` of the three pools' size.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from support.routers import (
    REPLICA_BLOCKS,
    client,
    hit_rate,
    per_replica,
    shared_pool_hit_rate,
    shared_prefix_traffic,
    start_router,
    wait_synced,
)
from support.servers import ADMIN, ADMIN_KEY, TENANT_KEYS, start_server, stop_server

pytestmark = pytest.mark.slow
MODEL = "default-model-v1"


def reset(router) -> None:
    r = httpx.post(router.url + "/reset_prefix_cache", params={"wait": "true"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["success"] and len(r.json()["replicas"]) == 3


def test_prefix_policies_hit_far_more_than_round_robin_and_near_one_shared_pool(routers, replicas, default_model_dir):
    traffic = shared_prefix_traffic(rounds=4)
    rates = {}
    for policy in ("round-robin", "prefix", "kv-events"):
        router = routers[policy]
        reset(router)
        rates[policy] = hit_rate(router, traffic)
    reset(routers["round-robin"])
    shared = shared_pool_hit_rate(replicas[0], default_model_dir, traffic)
    print("hit rates", rates, "shared pool", shared)
    for policy in ("prefix", "kv-events"):
        assert rates[policy] > rates["round-robin"] + 0.25, rates
        assert rates[policy] >= shared - 0.1, (rates, shared)
    m = routers["kv-events"].metrics()
    reported = sum(per_replica(m, "reported_cached_tokens_total").values())
    predicted = sum(per_replica(m, "predicted_cached_tokens_total").values())
    assert reported > 0 and predicted > 0.8 * reported, (predicted, reported)  # the router hashes like a replica


@pytest.mark.parametrize("policy", ["prefix", "kv-events"])
def test_one_dominant_prefix_spreads_over_replicas(routers, policy):
    router = routers[policy]
    reset(router)
    before = per_replica(router.metrics(), "requests_total")
    hot = shared_prefix_traffic(rounds=1)[0][0]

    async def burst() -> None:
        c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
        async with c:
            await asyncio.gather(*(c.chat.completions.create(
                model=MODEL, max_tokens=8, messages=[hot, {"role": "user", "content": f"Question {i}?"}])
                for i in range(24)))

    asyncio.run(burst())
    after = per_replica(router.metrics(), "requests_total")
    counts = [after[u] - before.get(u, 0) for u in after]
    assert sum(counts) == 24 and max(counts) <= 0.6 * 24, counts  # the load cap spreads one hot prefix
    assert sorted(counts)[-2] > 0


def test_streaming_passes_through_with_cached_tokens(routers):
    router = routers["kv-events"]
    messages = shared_prefix_traffic(rounds=1)[0]
    c = client(router)
    c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert sum(1 for ch in chunks if ch.choices) >= 1


def test_a_killed_replica_loses_no_request_and_a_restarted_one_is_resynced(routers, replicas, router_tmp):
    router = routers["kv-events"]
    resyncs_before = per_replica(router.metrics(), "kv_events_resyncs_total")
    traffic = shared_prefix_traffic(rounds=2)
    killed: list[int] = []

    async def run_and_kill() -> list:
        c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
        async with c:
            tasks = [asyncio.create_task(c.chat.completions.create(model=MODEL, messages=m, max_tokens=16))
                     for m in traffic]
            # The victim is a replica with requests in flight: killed mid-answer, they must be retried elsewhere.
            deadline = time.monotonic() + 60
            while not killed and time.monotonic() < deadline:
                busy = per_replica(await asyncio.to_thread(router.metrics), "requests_in_flight")
                url = max(busy, key=busy.get)
                if busy[url] >= 1:
                    i = [r.url for r in replicas].index(url)
                    replicas[i].proc.send_signal(signal.SIGKILL)
                    killed.append(i)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run_and_kill())  # none of them streamed, so every one must come back
    assert killed, "no replica had a request in flight to kill"
    victim = replicas[killed[0]]
    assert len(results) == len(traffic) and all(r.choices[0].finish_reason for r in results)
    victim.proc.wait(timeout=10)
    m = router.metrics()
    assert per_replica(m, "replica_healthy")[victim.url] == 0
    assert sum(per_replica(m, "retries_total").values()) >= 1
    assert all(client(router).chat.completions.create(model=MODEL, messages=msg, max_tokens=1).choices
               for msg in traffic[:3])  # served by the two that are left

    port = int(victim.url.rsplit(":", 1)[1])
    replicas[killed[0]] = start_server(router_tmp, "--num-gpu-blocks", str(REPLICA_BLOCKS), "--max-num-seqs",
                                       "16", port=port)  # same URL, new process: a new epoch
    m = wait_synced(router, 3, events=True)
    assert per_replica(m, "kv_events_resyncs_total")[victim.url] > resyncs_before[victim.url]
    c = client(router)
    for _ in range(6):  # the restarted replica is back in rotation, and its mirror follows it
        c.chat.completions.create(model=MODEL, messages=traffic[0], max_tokens=1)
    assert per_replica(router.metrics(), "replica_healthy")[victim.url] == 1
    settled(router)  # the retried, the cut off and the finished requests all released their load


def settled(router, timeout: float = 10.0) -> None:
    """Waits until the router counts nothing in flight and no queued prefill anywhere."""
    deadline = time.monotonic() + timeout
    while True:
        m = router.metrics()
        load = [*per_replica(m, "requests_in_flight").values(), *per_replica(m, "queued_prefill_blocks").values()]
        if not any(load):
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


@pytest.mark.parametrize("policy", ["round-robin", "kv-events"])
def test_a_client_that_leaves_mid_stream_releases_its_load(routers, policy):
    router = routers[policy]
    messages = shared_prefix_traffic(rounds=1)[0]
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = 0
        while events < 3:  # the role event, then tokens: the prompt is prefilled
            events += next(lines).startswith("data:")
        m = router.metrics()
        assert sum(per_replica(m, "requests_in_flight").values()) == 1
        assert sum(per_replica(m, "queued_prefill_blocks").values()) == 0  # running, no longer queued
    settled(router)  # hung up mid-stream: nothing left counted


def test_the_router_checks_the_same_keys_as_the_replicas(router_tmp, replicas, default_model_dir):
    keys = router_tmp / "router-keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    router = start_router(router_tmp, [s.url for s in replicas], "round-robin", default_model_dir,
                          "--api-keys-file", str(keys), "--admin-key", ADMIN_KEY, admin=ADMIN)
    try:
        messages = shared_prefix_traffic(rounds=1)[0]
        with pytest.raises(openai.AuthenticationError):
            client(router).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        alice = openai.OpenAI(base_url=router.url + "/v1", api_key="key-alice", max_retries=0, timeout=60)
        assert alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).choices
        assert httpx.get(router.url + "/metrics", timeout=10).status_code == 401
        assert router.metrics(ADMIN)["kvprefix:router_unroutable_total"] == 0
        assert httpx.post(router.url + "/reset_prefix_cache", headers={"authorization": "Bearer key-alice"},
                          timeout=10).status_code == 401
    finally:
        assert stop_server(router) in (0, -15)


def test_session_keys_keep_a_conversation_on_one_replica(routers):
    router = routers["session"]
    c = client(router)
    assert [m.id for m in c.models.list().data] == [MODEL]
    messages = shared_prefix_traffic(rounds=1)[0]

    def replica(**kw) -> str:
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=1, **kw)
        return raw.headers["x-kvprefix-replica"]

    for key in ("alpha", "beta", "gamma"):
        assert len({replica(user=key) for _ in range(3)}) == 1
        assert len({replica(prompt_cache_key=key) for _ in range(3)}) == 1
        assert len({replica(extra_headers={"x-session-id": key}) for _ in range(3)}) == 1
    assert len({replica() for _ in range(9)}) > 1  # no key: by load, not all to one replica

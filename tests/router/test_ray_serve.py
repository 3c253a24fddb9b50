"""A real local Ray cluster with two engine replicas behind the Ray Serve app: it answers through the custom request
router, which makes the same choices as the standalone policy object replayed offline on the same sequence, for
`prefix` (its routed index, forgotten after a cache reset through the ingress) and `kv-events` (fed by the
replicas' event streams, followed through the handle); the admin calls reach every replica."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.redis_server import RedisServer, needs_redis
from support.routers import REPLICA_BLOCKS, shared_prefix_traffic
from support.servers import free_port

ray = pytest.importorskip("ray")
MODEL = "default-model-v1"
UNEVICTED_BLOCKS = 512  # room for every prompt of the traffic on either replica: the offline replay never evicts


def app(model_dir: str, policy: str, blocks: int = REPLICA_BLOCKS, **engine):
    """The Ray Serve app of two replicas of the session's small random checkpoint under ``policy`` (``engine``:
    more engine arguments)."""
    from kvprefix.cli import engine_replica
    from kvprefix.router.ray.app import build_app
    from kvprefix.server.app import ServerConfig

    engine_args = {"model": model_dir, "dtype": "float32", "device": "cpu", "num_gpu_blocks": blocks,
                   "max_num_seqs": 16, **engine}
    return build_app(engine_replica, engine_args, ServerConfig(served_model_name=MODEL), 2, policy, num_cpus=0.5)


@pytest.fixture
def serve_port(default_model_dir: str) -> Iterator[int]:
    """A fresh local cluster per test."""
    from ray import serve

    port = free_port()
    for attempt in range(3):  # Ray waits a fixed 30 s for the new raylet to register: a loaded machine can miss it
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, int]:
    """(replica that served, cached prompt tokens) of one short chat."""
    from kvprefix.router.ray.engine import REPLICA_HEADER

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2,
                                                           temperature=0)
    time.sleep(0.05)  # the router counts a request done a moment after its last byte: replay sees load 0
    return raw.headers[REPLICA_HEADER], raw.parse().usage.prompt_tokens_details.cached_tokens


def block_identity(app_name: str):
    """The request hasher of the deployment's replicas, as the ingress builds it."""
    from ray import serve

    from kvprefix.router.hashing import RequestHasher

    tokenizer, identity, max_model_len, _ = (
        serve.get_deployment_handle("Engine", app_name).block_identity.remote().result())
    return RequestHasher(tokenizer, identity.hasher(), max_model_len)


def same_choices(served: list[str], offline: list[int]) -> bool:
    """Whether the replicas that served are the offline choices, under one naming of Ray's replica ids as the
    policy's positions (the router places replicas in the order Ray reports them, which the test does not see)."""
    position: dict[str, int] = {}
    return all(position.setdefault(rid, k) == k for rid, k in zip(served, offline, strict=True)) and len(
        set(position.values())) == len(position) == 2


def test_replicas_keep_their_positions_and_each_reset_is_forgotten_once():
    """The request router's placement (real Ray replica ids, the prefix policy's real index): a replacement takes
    the position its predecessor left, with nothing remembered there; every call carries the ingress's reset
    counts, and each reset empties the index once, however many calls (or asks about one request) bring it."""
    from ray.serve._private.common import DeploymentID  # ReplicaID's own field; Ray exports no public constructor

    from kvprefix.router.fleet import Replica
    from kvprefix.router.ledger import Ledger
    from kvprefix.router.policies import PrefixScore, RoutedIndex
    from kvprefix.router.ray.routing import ReplicaID, ReplicaSlots

    deployment = DeploymentID(name="Engine", app_name="kvprefix")
    a, b, c = (ReplicaID(u, deployment) for u in "abc")
    routed = RoutedIndex(64)
    slots = ReplicaSlots(Ledger(PrefixScore("prefix", routed=routed)), Replica)
    slots.place({b, a})
    assert slots.slots == [a, b]
    routed.record(0, ["x", "y"])
    routed.record(1, ["x"])
    slots.place({a, b}, [("a", 1)])
    assert routed.cached_prefix_blocks(0, ["x", "y"]) == 0 and routed.cached_prefix_blocks(1, ["x"]) == 1
    routed.record(0, ["x", "y"])  # the call that brought the reset, placed after it
    for _ in range(3):  # Ray asks again about that request, later calls carry the same count
        slots.place({a, b}, [("a", 1)])
    assert routed.cached_prefix_blocks(0, ["x", "y"]) == 2
    slots.place({a, b}, [("a", 2), ("b", 1)])  # reset again, both this time
    assert routed.cached_prefix_blocks(0, ["x"]) == 0 and routed.cached_prefix_blocks(1, ["x"]) == 0
    routed.record(1, ["x"])
    slots.place({a, c}, [("a", 2), ("b", 1)])  # b gone, c new: c takes b's position, which holds nothing of b's
    assert slots.slots == [a, c] and routed.cached_prefix_blocks(1, ["x"]) == 0
    assert set(slots.replicas) == {a, b, c}


def test_the_ray_view_credits_the_tiers_the_ingress_hands_over():
    """The ingress hands over, per replica, the request's blocks in its pool and in the shared tier it reads; the
    request router's view credits them as `kvprefix route`'s does (with the replicas' tiers from their hellos)."""
    from ray.serve._private.common import DeploymentID

    from kvprefix.cache.media import POOL, SHARED, Medium
    from kvprefix.router.fleet import Replica
    from kvprefix.router.hashing import RouteRequest
    from kvprefix.router.ledger import Ledger
    from kvprefix.router.policies import Held, make_policy
    from kvprefix.router.ray.routing import ReplicaID, ReplicaSlots

    deployment = DeploymentID(name="Engine", app_name="kvprefix")
    a, b = (ReplicaID(u, deployment) for u in "ab")
    media = {POOL: Medium(POOL, 64), SHARED: Medium(SHARED, None, 0.125, "redis-1")}
    slots = ReplicaSlots(Ledger(make_policy("kv-events")), lambda rid: Replica(rid, media_info=media))
    slots.place({a, b})
    prefix = tuple(f"h{i}" for i in range(10))
    route = RouteRequest((*prefix, "q"), None, 12, held={"a": {POOL: frozenset(prefix), SHARED: frozenset(prefix)},
                                                         "b": {SHARED: frozenset(prefix)}})
    view = slots.view(route)
    assert [view.held_prefix(r, route.block_hashes) for r in (0, 1)] == [Held(pool=10), Held(0, 0, 10, 0, 0.125)]
    slots.replicas[a].outstanding.add([], 4)  # a is prefilling: b loads the prefix instead of computing it
    decision = slots.ledger.choose(route, slots.view(route))
    assert (decision.replica, decision.credited, decision.load_cost) == (1, 10, 1.25)


def test_a_request_refused_by_a_full_replica_is_a_retry_counted_where_it_went():
    """Ray asks again about a request whose replica refused it: the ledger's second decision is a retry naming the
    refusing replica; the request is counted (decision, load, queued prefill) at the replica that took it, the
    refusal as that replica's retry, and its load settles when Ray says it completed."""
    from ray.serve._private.common import DeploymentID

    from kvprefix.router.fleet import FleetView, Replica
    from kvprefix.router.hashing import RouteRequest
    from kvprefix.router.metrics import RouterMetrics
    from kvprefix.router.policies import make_policy
    from kvprefix.router.ray.routing import RayRouting, ReplicaID

    deployment = DeploymentID(name="Engine", app_name="kvprefix")
    a, b = (ReplicaID(u, deployment) for u in "ab")
    view = FleetView([])
    metrics = RouterMetrics(view)
    replicas: dict[str, Replica] = {}

    def replica(replica_id: str) -> Replica:
        if replica_id not in replicas:
            replicas[replica_id] = rep = Replica(replica_id)
            view.replicas.append(rep)
            metrics.add_replica(rep)
        return replicas[replica_id]

    routing = RayRouting(make_policy("round-robin"), metrics, replica)
    routing.placement.place({a, b})
    route = RouteRequest(("x", "y"), None, num_blocks=3)
    assert routing.choose("r1", route, {a, b}) == a
    assert routing.choose("r1", route, {a, b}) == b  # asked again: a refused it
    routing.routed("r1", b)

    def sample(name: str, **labels) -> float:
        return metrics.registry.get_sample_value("kvprefix:router_" + name, labels) or 0.0

    assert sample("requests_total", replica="b", reason="retry") == 1
    assert sample("requests_total", replica="a", reason="no_prefix") == 0
    assert sample("retries_total", replica="a") == 1
    assert (replicas["b"].outstanding.requests, replicas["b"].outstanding.queued_prefill_blocks) == (1, 3)
    routing.completed("r1")
    routing.completed("r1")
    assert (replicas["b"].outstanding.requests, replicas["b"].outstanding.queued_prefill_blocks) == (0, 0)


@pytest.mark.slow
def test_ray_serve_routes_like_the_standalone_prefix_policy(serve_port: int, default_model_dir: str):
    from ray import serve

    from kvprefix.router.fleet import FleetView, Replica
    from kvprefix.router.hashing import RouteRequest
    from kvprefix.router.policies import make_policy
    serve.run(app(default_model_dir, "prefix"), name="kvprefix", route_prefix="/")
    try:
        base = f"http://127.0.0.1:{serve_port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        assert httpx.get(base + "/health").status_code == 200  # anywhere, moves no rotation
        traffic = shared_prefix_traffic(rounds=3)
        served, cached = zip(*(chat(client, m) for m in traffic), strict=True)
        chunks = list(client.chat.completions.create(model=MODEL, messages=traffic[0], max_tokens=3, stream=True))
        hasher = block_identity("kvprefix")

        # A reset through the ingress empties every replica; the router's routed index must forget them too
        before = router_metrics(base)
        reset = httpx.post(base + "/reset_prefix_cache", params={"wait": "true"}, timeout=60)
        assert reset.status_code == 200 and reset.json()["success"], reset.text
        after_reset = chat(client, traffic[-1])
        after = router_metrics(base)
    finally:
        serve.delete("kvprefix")

    policy, view = make_policy("prefix"), FleetView([Replica("a", True), Replica("b", True)])
    offline = []
    for m in [*traffic, traffic[0]]:  # the streamed request last
        hashes, num_blocks = hasher.hash_prompt({"messages": m}, None)
        offline.append(policy.choose(RouteRequest(tuple(hashes), None, num_blocks), view).replica)
    assert same_choices(served, offline[:-1]), (served, offline)
    first_round = len(traffic) // 3
    assert all(c > 0 for c in cached[first_round:]), cached  # every later question hits its system prompt
    assert any(c.choices and c.choices[0].delta.content for c in chunks)

    # Had the index not forgotten, the last prompt would be credited at the replica it went to before
    hashes, num_blocks = hasher.hash_prompt({"messages": traffic[-1]}, None)
    stale = copy.deepcopy(policy)
    assert stale.choose(RouteRequest(tuple(hashes), None, num_blocks), view).credited > 0
    assert after_reset[1] == 0  # the replica's cache was emptied
    def grew(name: str, reason: str | None = None) -> float:
        return sum(by_replica(after, name, reason).values()) - sum(by_replica(before, name, reason).values())
    assert grew("requests_total", "no_prefix") == 1 and grew("requests_total", "cached_prefix") == 0
    assert grew("predicted_cached_tokens_total") == 0


def replay_kv_events(hasher, traffic: list[list[dict]]) -> list[int]:
    """The standalone kv-events policy's choices for the same sequence: the planner's replay on real cache managers
    (one per replica, none evicting), which is what the replicas' event streams tell the ingress."""
    from kvprefix.cache import cdiv
    from kvprefix.sim.replay import ReplayConfig, replay
    from kvprefix.sim.trace import Trace, TraceRequest

    bs = hasher.hasher.block_size
    requests = []
    for messages in traffic:
        hashes, num_blocks = hasher.hash_prompt({"messages": messages}, None)
        length = len(hasher.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        requests.append(TraceRequest(0.0, length, 2, hashes, cdiv(length, bs)))
    return replay(Trace("ray", bs, requests), ReplayConfig(None, replicas=2, routing="kv-events", mode="order")).replica


def router_metrics(base: str) -> dict[tuple[str, str, str], float]:
    """The ingress's /metrics: (sample name, replica, reason) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = httpx.get(base + "/metrics", timeout=30)
    assert answer.status_code == 200, answer.text
    out = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            out[sample.name, sample.labels.get("replica", ""), sample.labels.get("reason", "")] = sample.value
    return out


def by_replica(metrics: dict, name: str, reason: str | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for (sample, replica, why), value in metrics.items():
        if sample == "kvprefix:router_" + name and (reason is None or why == reason):
            out[replica] = out.get(replica, 0.0) + value
    return out


@pytest.mark.slow
def test_ray_serve_kv_events_routes_like_the_standalone_policy_and_admin_calls_reach_every_replica(
        serve_port: int, default_model_dir: str):
    from ray import serve
    serve.run(app(default_model_dir, "kv-events", UNEVICTED_BLOCKS), name="kvprefix-kv", route_prefix="/")
    try:
        base = f"http://127.0.0.1:{serve_port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        traffic = shared_prefix_traffic(rounds=3)
        served, cached = zip(*(chat(client, m) for m in traffic), strict=True)
        hasher = block_identity("kvprefix-kv")
        # Credit-free rotation (an index empty or stale at decision time) puts the second round elsewhere.
        offline = replay_kv_events(hasher, traffic)
        assert same_choices(served, offline), (served, offline)
        assert all(c > 0 for c in cached[len(traffic) // 3:]), cached

        # The router's metrics through the ingress: its decisions, per replica
        m = router_metrics(base)
        assert by_replica(m, "requests_total") == {rid: served.count(rid) for rid in set(served)}
        first_round = len(traffic) // 3
        assert sum(by_replica(m, "requests_total", "no_prefix").values()) == first_round  # new prompts
        assert sum(by_replica(m, "requests_total", "cached_prefix").values()) == len(traffic) - first_round
        reported = sum(by_replica(m, "reported_cached_tokens_total").values())
        predicted = sum(by_replica(m, "predicted_cached_tokens_total").values())
        assert reported == sum(cached) and predicted > 0.8 * reported, (predicted, reported)
        assert by_replica(m, "replica_healthy") == {rid: 1.0 for rid in set(served)}
        assert all(v > 0 for v in by_replica(m, "kv_events_blocks").values())  # synced, holding the prompts
        assert by_replica(m, "kv_events_resyncs_total").keys() == set(served)
        assert sum(by_replica(m, "retries_total").values()) == 0
        assert by_replica(m, "requests_in_flight") == {rid: 0.0 for rid in set(served)}
        assert m["kvprefix:router_load_imbalance", "", ""] == 1.0

        reset = httpx.post(base + "/reset_prefix_cache", params={"wait": "true"}, timeout=60)
        assert reset.status_code == 200, reset.text
        assert reset.json()["success"]
        assert {r["replica"] for r in reset.json()["replicas"]} == set(served)  # each replica once
        assert all(r["status"] == 200 for r in reset.json()["replicas"])
        time.sleep(1)
        assert chat(client, traffic[0])[1] == 0  # every replica's cache was emptied
        flush = httpx.post(base + "/flush_cache", timeout=60)
        assert flush.status_code == 200, flush.text
        assert {r["replica"] for r in flush.json()["replicas"]} == set(served)
    finally:
        serve.delete("kvprefix-kv")


@pytest.mark.slow
@needs_redis
def test_a_prefix_one_ray_replica_computed_hits_on_the_other_through_the_shared_tier(serve_port, default_model_dir,
                                                                                   tmp_path):
    from ray import serve

    redis = RedisServer(tmp_path).start()
    serve.run(app(default_model_dir, "round-robin", kv_shared=redis.url), name="kvprefix", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="none", max_retries=0)
        system = shared_prefix_traffic(rounds=1)[0][0]
        first, cached = chat(client, [system, {"role": "user", "content": "Question A?"}])
        assert cached == 0
        with redis.client() as c:  # the first replica's write-behind has landed
            deadline = time.monotonic() + 30
            while c.dbsize() < 16 and time.monotonic() < deadline:
                time.sleep(0.05)
        second, cached = chat(client, [system, {"role": "user", "content": "Question B?"}])
        assert second != first and cached >= 16 * 16, (first, second, cached)  # round robin: the other replica
    finally:
        serve.delete("kvprefix")
        redis.stop()

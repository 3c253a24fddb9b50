"""A real local Ray cluster with two engine replicas behind the Ray Serve app: it answers through the custom request
router, which makes the same choices as the standalone policy object replayed offline on the same sequence; with
kv-events it follows the replicas' event streams, and the admin calls reach every replica."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from router_helpers import REPLICA_BLOCKS, shared_prefix_traffic
from server_helpers import free_port

ray = pytest.importorskip("ray")
MODEL = "default-model-v1"


def app(model_dir: str, policy: str):
    """The Ray Serve app of two replicas of the session's small random checkpoint under ``policy``."""
    from kvprefix.router.ray_serve import build_app
    from kvprefix.server.app import ServerConfig

    engine_args = {"model": model_dir, "dtype": "float32", "device": "cpu", "num_gpu_blocks": REPLICA_BLOCKS,
                   "max_num_seqs": 16}
    return build_app(engine_args, 2, policy, num_cpus=0.5, config=ServerConfig(served_model_name=MODEL))


@pytest.fixture
def serve_port(default_model_dir: str) -> Iterator[int]:
    """A fresh local cluster per test."""
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, int]:
    """(replica that served, cached prompt tokens) of one short chat."""
    from kvprefix.router.ray_serve import REPLICA_HEADER

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2,
                                                           temperature=0)
    time.sleep(0.05)  # the router counts a request done a moment after its last byte: replay sees load 0
    return raw.headers[REPLICA_HEADER], raw.parse().usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
def test_ray_serve_routes_like_the_standalone_policy(serve_port: int, default_model_dir: str):
    from ray import serve

    from kvprefix.cache import BlockHasher
    from kvprefix.router.hashing import RequestHasher, RouteRequest
    from kvprefix.router.policies import make_policy
    from kvprefix.router.ray_serve import _SlotView

    serve.run(app(default_model_dir, "prefix"), name="kvprefix", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="none", max_retries=0)
        assert httpx.get(f"http://127.0.0.1:{serve_port}/health").status_code == 200  # anywhere, moves no rotation
        traffic = shared_prefix_traffic(rounds=3)
        served, cached = zip(*(chat(client, m) for m in traffic), strict=True)
        chunks = list(client.chat.completions.create(model=MODEL, messages=traffic[0], max_tokens=3, stream=True))
        tokenizer, block_size, algo, context = (
            serve.get_deployment_handle("Engine", "kvprefix").block_identity.remote().result())
    finally:
        serve.delete("kvprefix")
    hasher = RequestHasher(tokenizer, BlockHasher(block_size, algo, context))

    # Positions are replica ids in sorted order, as the router places a fresh deployment's replicas.
    position = {rid: i for i, rid in enumerate(sorted(set(served)))}
    policy, view = make_policy("prefix"), _SlotView(["a", "b"], {"a", "b"}, {})
    offline = []
    for m in traffic:
        hashes, num_blocks = hasher.hash_prompt({"messages": m}, None)
        offline.append(policy.choose(RouteRequest(hashes, None, num_blocks), view))
    assert [position[rid] for rid in served] == offline
    assert len(position) == 2
    first_round = len(traffic) // 3
    assert all(c > 0 for c in cached[first_round:]), cached  # every later question hits its system prompt
    assert any(c.choices and c.choices[0].delta.content for c in chunks)


@pytest.mark.slow
def test_ray_serve_kv_events_app_serves_and_admin_calls_reach_every_replica(serve_port: int, default_model_dir: str):
    from ray import serve

    serve.run(app(default_model_dir, "kv-events"), name="kvprefix-kv", route_prefix="/")
    try:
        base = f"http://127.0.0.1:{serve_port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        traffic = shared_prefix_traffic(rounds=2)
        served = [chat(client, m) for m in traffic]  # the kv-events app answers (its event-fed credit is not
        assert len({rid for rid, _ in served}) == 2  # checked here: see docs/router.md, Ray Serve, not there yet)

        reset = httpx.post(base + "/reset_prefix_cache", params={"wait": "true"}, timeout=60)
        assert reset.status_code == 200, reset.text
        assert reset.json()["success"] and len(reset.json()["replicas"]) == 2
        assert all(r["status"] == 200 for r in reset.json()["replicas"])
        time.sleep(3)
        assert chat(client, traffic[0])[1] == 0  # every replica's cache was emptied
        flush = httpx.post(base + "/flush_cache", timeout=60)
        assert flush.status_code == 200 and len(flush.json()["replicas"]) == 2, flush.text
    finally:
        serve.delete("kvprefix-kv")
